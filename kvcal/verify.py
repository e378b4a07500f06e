"""``kvcal verify``: serve an exported checkpoint in a real engine and compare with kvcal's prediction.

Pipeline (:func:`verify`):

1. Read the checkpoint as vLLM would: ``config.json``'s ``kv_cache_scheme`` names the FP8 dtype and the
   ``model.layers.{i}.self_attn.{k,v,q}_scale`` tensors of its safetensors files are the static scales
   (:func:`read_checkpoint`). A ``kvcal recommend`` output is recognised and pointed at its export line.
2. Build a scale-free view of the checkpoint (:func:`no_scale_view`: the same weight files, linked, with
   ``quantization_config`` and the scale tensors left out): what a user serves without kvcal's scales.
3. Cut the evaluation windows exactly as ``kvcal evaluate`` does (:func:`kvcal.evaluate.windows.corpus_stream`,
   :func:`~kvcal.evaluate.windows.cut_windows`) and serve them in the engine's own Python
   (``kvcal/engines/vllm_runner.py``, a subprocess): the engine's 16-bit cache (``auto`` on the view) is
   the reference, then the dtype with the checkpoint's scales, then the dtype at 1.0 (the view).
4. Predict the same runs with kvcal's emulation of that engine backend (:class:`~kvcal.vllm_plan.VllmKVPlan`,
   the backend the engine reports: ``CPUAttentionBackendImpl`` → ``cpu``) on kvcal's own 16-bit model
   (transformers, same weights), per token.
5. Judge: PASS/FAIL against ``--accept`` on the *served* figures, and served = predicted within the
   tolerance of :func:`agreement` (derived in ``docs/serving.md``: a paired t-interval over windows plus
   the two implementations' 16-bit disagreement). Scales applied: every layer's loaded scale equals the
   checkpoint's, and the served run differs from the run at 1.0.

Raises :class:`~kvcal.errors.KvcalError` (one line) for every input or environment problem, including
an engine that refuses the model or the dtype on this CPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvcal.errors import KvcalError

RUNNER = Path(__file__).resolve().parent / "engines" / "vllm_runner.py"
#: metrics ``verify --accept`` can judge (it measures no greedy agreement)
VERIFY_METRICS = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree")
#: engine attention implementation class → kvcal backend (:data:`kvcal.formats.vllm_dtypes.VLLM_BACKENDS`)
IMPL_BACKEND = {"CPUAttentionBackendImpl": "cpu"}
#: the served log-probability of each target token must equal log_softmax of the observed logit row to this
#: (nats): float32 log-softmax over a 49k vocabulary agrees with a float64 one to ~1e-5
ALIGN_TOL = 1e-3
#: two-sided confidence of the served-vs-predicted interval
CONFIDENCE = 0.99
_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v|q)_scale$")
_FP8_SCHEMES = {(8, "float"): "fp8"}


@dataclass(frozen=True)
class VerifyConfig:
    """Options of ``kvcal verify``. ``checkpoint``: an exported checkpoint directory (``kvcal export
    --target vllm --model-dir``); ``engine_python``: the engine's interpreter; ``contexts``/``windows``
    as ``kvcal evaluate``; ``kv_cache_dtype``: ``None`` = the checkpoint's (``fp8``); ``backend``:
    ``None`` = the one the engine reports; ``accept``: bar on the served figures (``None``: the 8-bit
    bar of :data:`kvcal.evaluate.accept.DEFAULT_ACCEPT`)."""

    checkpoint: str
    corpus: str
    engine_python: str
    context: int = 1024
    windows: int = 8
    kv_cache_dtype: str | None = None
    backend: str | None = None
    accept: str | None = None
    timeout_s: int = 1800
    skip_layers: tuple[int, ...] = ()  # --kv-cache-dtype-skip-layers served (and predicted) in the model dtype
    model_dir: str | None = None  # a recommend output: the HF checkpoint its export line merges into / it serves
    text_field: str | None = None
    messages_field: str | None = None
    split: str | None = None

    def __post_init__(self):
        if self.context < 2:
            raise KvcalError("--context must be at least 2")
        if self.windows < 2:
            raise KvcalError("--windows must be at least 2 (the served-vs-predicted interval needs two windows)")
        if self.accept is not None:
            check_accept(self.accept)


def check_accept(spec: str) -> list:
    """``--accept`` of verify: :func:`kvcal.options.parse_bar` with :data:`VERIFY_METRICS` (a metric verify does
    not measure, or a bar that can never pass or always passes, is refused)."""
    from kvcal.options import parse_bar

    return parse_bar(spec, VERIFY_METRICS, "verify",
                     why_not={"greedy_agree": "verify serves prompts teacher-forced (no greedy decoding)",
                              "greedy_prefix": "verify serves prompts teacher-forced (no greedy decoding)"})


def check_engine_python(path: str) -> Path:
    """The engine interpreter ``path`` if it is an executable file; else a one-line :class:`KvcalError`
    saying how to build one (``make engine-venv``)."""
    p = Path(os.path.abspath(path))  # absolute, not resolved: a venv's python is a link that must stay one
    if not p.is_file() or not os.access(p, os.X_OK):
        raise KvcalError(f"--engine-python {path}: no executable Python there; build vLLM's CPU build beside "
                         "kvcal with `make engine-venv` (then --engine-python .venv-vllm-cpu/bin/python)")
    return p


def cpu_fp8_support(cpuinfo: str | None = None) -> str | None:
    """``None`` when this x86 CPU has AVX-512 or AMX (what vLLM's CPU backend needs for an FP8 cache,
    ``cpu_attn.py`` ``_get_attn_isa``), else the reason it cannot. ``cpuinfo``: the text of
    ``/proc/cpuinfo`` (read when ``None``)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "cannot read /proc/cpuinfo to check for AVX-512 or AMX"
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[-1].split())
    if "avx512f" in flags or "amx_tile" in flags:
        return None
    return "this CPU has neither AVX-512 nor AMX; vLLM's CPU backend serves an FP8 KV cache only with one of them"


@dataclass
class Checkpoint:
    """What vLLM reads of a checkpoint: ``kv_cache_dtype`` from ``kv_cache_scheme`` (``None``: no
    scheme), per-layer scales (``None`` entries: absent), the model shape, the files."""

    path: Path
    config: dict
    kv_cache_dtype: str | None
    k_scales: list
    v_scales: list
    q_scales: list
    scale_files: dict = field(default_factory=dict)  # file name -> scale tensor names in it

    @property
    def num_layers(self) -> int:
        return int(self.text_config.get("num_hidden_layers") or 0)

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config

    @property
    def head_dim(self) -> int | None:
        c = self.text_config
        hd = c.get("head_dim") or (c.get("hidden_size", 0) // max(int(c.get("num_attention_heads") or 1), 1))
        return int(hd) if hd else None


def from_recommend(path: Path, model_dir: str | None, work: Path, log=print) -> tuple[str, str, tuple[int, ...]]:
    """A ``kvcal recommend`` output ``path`` → ``(checkpoint dir, kv_cache_dtype, skip layers)`` to verify: the chosen
    row's artifact exported into ``work`` with its export line's options (``--target vllm --clipped-scales``) and
    ``model_dir``, or, for a row at vLLM's default scales, ``model_dir`` itself. Raises :class:`KvcalError` when
    nothing was chosen, the chosen dtype is not a static FP8 one, or ``model_dir`` is missing."""
    try:
        d = json.loads((path / "deploy.json").read_text())
    except (OSError, ValueError) as e:
        raise KvcalError(f"{path / 'deploy.json'}: cannot read ({e})") from None
    c = d.get("chosen") if isinstance(d, dict) else None
    if not isinstance(c, dict):
        raise KvcalError(f"{path}: kvcal recommend chose no configuration (nothing passed its bar); nothing to verify")
    dtype, skip = c.get("dtype"), tuple(int(i) for i in c.get("skip_layers") or ())
    if dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        raise KvcalError(f"{path}: the chosen --kv-cache-dtype {dtype} is not one verify serves (fp8, fp8_e4m3, "
                         "fp8_e5m2: vLLM's CPU build serves no other)")
    if model_dir is None:
        raise KvcalError(f"{path} is a kvcal recommend output: pass --model-dir HF_DIR, the Hugging Face checkpoint "
                         "its export line merges the scales into (or serves, at vLLM's default scales)")
    if not d.get("artifact"):
        log(f"recommend chose {dtype} at vLLM's default scales: serving {model_dir} without scales")
        return model_dir, dtype, skip
    from kvcal.export import export

    out = work / "recommend-export"
    export(str(path / d["artifact"]), "vllm", str(out), model_dir=model_dir, clipped_scales=True)
    log(f"recommend chose {dtype} with calibrated scales: exported {path / d['artifact']} into a temporary checkpoint")
    return str(out), dtype, skip


def read_checkpoint(path: str) -> Checkpoint:
    """Read ``path`` as vLLM's loader would (see module doc). Raises :class:`KvcalError` for a missing
    directory or config, a ``kvcal recommend`` output (pointing at its export line), a KV scheme kvcal
    does not verify, or scales that are not positive finite scalars."""
    from safetensors import safe_open

    p = Path(path)
    if (p / "deploy.json").is_file() and not (p / "config.json").is_file():
        line = ""
        try:
            d = json.loads((p / "deploy.json").read_text())
            line = (d.get("choice") or {}).get("export") or d.get("export") or ""
        except (OSError, ValueError, AttributeError):
            pass
        raise KvcalError(f"{p} is a kvcal recommend output, not a checkpoint; export it first"
                         + (f" ({line})" if isinstance(line, str) and line else
                            " (kvcal export --artifact <its artifact> --target vllm --model-dir HF_DIR --out OUT)")
                         + ", then verify OUT; or give kvcal verify the recommend output with --model-dir HF_DIR")
    if not p.is_dir():
        raise KvcalError(f"checkpoint {p} is not a directory; pass the output of kvcal export --target vllm --model-dir")
    if (p / "kv_scales.safetensors").is_file() and not (p / "config.json").is_file():
        raise KvcalError(f"{p} is a kvcal artifact, not a checkpoint; export it first (kvcal export --artifact {p} "
                         "--target vllm --model-dir HF_DIR --out OUT), then verify OUT")
    try:
        config = json.loads((p / "config.json").read_text())
    except OSError:
        raise KvcalError(f"checkpoint {p} has no config.json; pass a Hugging Face checkpoint directory "
                         "(kvcal export --target vllm --model-dir HF_DIR --out OUT)") from None
    except ValueError as e:
        raise KvcalError(f"{p / 'config.json'}: invalid JSON ({e})") from None
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    dtype = None
    if scheme:
        key = (scheme.get("num_bits"), scheme.get("type"))
        if key not in _FP8_SCHEMES or scheme.get("strategy") != "tensor":
            raise KvcalError(f"{p / 'config.json'}: kv_cache_scheme {scheme} is not a per-tensor FP8 scheme; "
                             "kvcal verify checks per-tensor FP8 checkpoints (vLLM's CPU backend serves no other)")
        dtype = _FP8_SCHEMES[key]
    L = int((config.get("text_config") or config).get("num_hidden_layers") or 0)
    scales = {s: [None] * L for s in "kvq"}
    files: dict[str, list[str]] = {}
    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for name in st.keys():
                    m = _SCALE_RE.match(name)
                    if m and int(m.group(1)) < L:
                        t = st.get_tensor(name).double().reshape(-1)
                        if t.numel() != 1 or not bool(t.isfinite().all()) or float(t[0]) <= 0:
                            raise KvcalError(f"{f}: {name} must be one positive finite value, got {t.tolist()[:4]}")
                        scales[m.group(2)][int(m.group(1))] = float(t[0])
                        files.setdefault(f.name, []).append(name)
        except KvcalError:
            raise
        except Exception as e:
            raise KvcalError(f"{f}: cannot read as safetensors ({type(e).__name__}: {e})") from None
    return Checkpoint(p, config, dtype, scales["k"], scales["v"], scales["q"], files)


def no_scale_view(ck: Checkpoint, out: Path) -> Path:
    """A directory ``out`` that serves ``ck``'s weights without its KV scales: every file linked
    except ``config.json`` (written without ``quantization_config``), scale-only safetensors files
    (left out) and ``model.safetensors.index.json`` (rewritten without the scale entries). Returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    scale_names = {n for names in ck.scale_files.values() for n in names}
    for f in ck.path.iterdir():
        if f.name in ("config.json", "model.safetensors.index.json") or not f.is_file():
            continue
        if f.name in ck.scale_files and _only_scales(f, set(ck.scale_files[f.name])):
            continue
        os.symlink(f.resolve(), out / f.name)
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    idx = ck.path / "model.safetensors.index.json"
    if idx.is_file():
        d = json.loads(idx.read_text())
        d["weight_map"] = {k: v for k, v in d.get("weight_map", {}).items() if k not in scale_names
                           and (out / v).exists()}
        (out / idx.name).write_text(json.dumps(d, indent=2))
    return out


def _only_scales(f: Path, names: set) -> bool:
    from safetensors import safe_open

    with safe_open(str(f), "pt") as st:
        return set(st.keys()) <= names


def t_quantile(confidence: float, dof: int) -> float:
    """Two-sided Student-t quantile ``t_{(1+confidence)/2, dof}`` (scipy)."""
    from scipy.stats import t

    return float(t.ppf((1 + confidence) / 2, dof))


def agreement(served: list[float], predicted: list[float], floor: float = 0.0,
              confidence: float = CONFIDENCE) -> dict:
    """Served vs predicted per window → ``{"diff", "tol", "ok"}``.

    ``served``/``predicted``: one figure per evaluation window (the same windows, the same tokens), so
    their differences ``d_w`` are paired. The windows are independent samples of the corpus, so the
    mean difference has the t-interval ``t_{(1+c)/2, N−1} · sd(d_w) / √N``; ``floor`` adds what the
    two implementations disagree by without quantization (their 16-bit runs). ``ok``: ``|mean d| ≤ tol``.
    A missing emulation detail (a rounding mode, a flush) biases every window the same way, which this
    interval does not absorb; arithmetic-order noise averages out."""
    import statistics

    n = len(served)
    d = [s - p for s, p in zip(served, predicted, strict=True)]
    diff = statistics.fmean(d)
    sd = statistics.stdev(d) if n > 1 else float("inf")
    tol = t_quantile(confidence, n - 1) * sd / math.sqrt(n) + floor
    return {"diff": diff, "tol": tol, "ok": abs(diff) <= tol}


def _window_means(rows: list[list[float]]) -> list[float]:
    return [sum(r) / len(r) for r in rows]


def run_engine(engine_python: Path, request: dict, workdir: Path, timeout_s: int = 1800) -> dict:
    """Run :data:`RUNNER` in ``engine_python`` on ``request`` (module doc of ``vllm_runner``); return its
    result. Raises :class:`KvcalError` with the engine's one-line refusal, a crash's last line, or a timeout."""
    req, res = workdir / "request.json", workdir / "result.json"
    req.write_text(json.dumps(request))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    # the engine runs as deployed: ATEN_CPU_CAPABILITY (kvcal's suite sets it to check its own arithmetic on other
    # kernels) makes torch inductor inside vLLM 0.32 emit C++ that does not compile ("'at::vec' has not been
    # declared") even with enforce_eager
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        proc = subprocess.run([str(engine_python), str(RUNNER), str(req), str(res)], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=str(workdir))
    except subprocess.TimeoutExpired:
        raise KvcalError(f"the engine did not finish within {timeout_s} s (--timeout); use fewer --windows or a "
                         "smaller --context") from None
    except OSError as e:
        raise KvcalError(f"--engine-python {engine_python}: cannot run it ({e.strerror or e})") from None
    out = None
    if res.is_file():
        try:
            out = json.loads(res.read_text())
        except ValueError:
            out = None
    if isinstance(out, dict) and out.get("error"):
        raise KvcalError(f"engine refused: {out['error']}")
    if proc.returncode != 0 or not isinstance(out, dict):
        tail = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        named = [ln for ln in tail if re.search(r"\w(Error|Exception|Failed)\b", ln)]  # the exception, not a hint
        raise KvcalError(f"the engine exited with status {proc.returncode}: "
                         f"{(named or tail or ['no message'])[-1][:400]} (--engine-python {engine_python})")
    return out


def predict(model, windows, plans: dict, chunk_rows: int = 256) -> dict:
    """kvcal's per-window figures for ``plans`` (name → VllmKVPlan) against ``model``'s 16-bit run, on
    ``windows`` int64 ``[N, T]``: name → ``{"nll": [[T−1 per window]], "kl": ..., "top1": ...}`` and
    ``"16-bit"`` (KL 0). NLL and KL in nats from float32 logits, reduced in float64.

    Memory: the 16-bit run's float32 log-probabilities of one window and one run's logits (``[T−1, V]``
    float32 each: 1.07 GB apiece for Gemma 3's 262,144-token vocabulary at 1,024 tokens), and ``chunk_rows``
    positions at a time in float64 for the KL; every operation is row-wise, so the figures do not depend on
    the chunking."""
    import torch

    from kvcal.evaluate.protocol_a import kl_terms, protocol_a_logits

    out = {name: {"nll": [], "kl": [], "top1": []} for name in ["16-bit", *plans]}
    with torch.no_grad():
        for w in windows:
            ids = w[None]
            tgt = ids[0, 1:]
            n = tgt.shape[0]
            parts = [(a, min(a + chunk_rows, n)) for a in range(0, n, chunk_rows)]
            logits = protocol_a_logits(model, ids, None)[0]
            lr32 = torch.empty(logits.shape, dtype=torch.float32)
            for a, b in parts:
                lr32[a:b] = torch.log_softmax(logits[a:b].float(), -1)
            del logits
            out["16-bit"]["nll"].append((-lr32.gather(-1, tgt[:, None]).double())[:, 0].tolist())
            out["16-bit"]["kl"].append([0.0] * n)
            out["16-bit"]["top1"].append([1] * n)
            for name, plan in plans.items():
                logits = protocol_a_logits(model, ids, plan)[0]
                nll, kl, top1 = [], [], []
                for a, b in parts:
                    lr = lr32[a:b].double()
                    lp = torch.log_softmax(logits[a:b].float(), -1).double()
                    nll += (-lp.gather(-1, tgt[a:b, None]))[:, 0].tolist()
                    kl += kl_terms(lr, lp).sum(-1).tolist()
                    top1 += (lr.argmax(-1) == lp.argmax(-1)).int().tolist()
                del logits
                out[name]["nll"].append(nll)
                out[name]["kl"].append(kl)
                out[name]["top1"].append(top1)
    return out


def summarize(run: dict, ref: dict) -> dict:
    """``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "tokens"}`` of a run's per-token rows."""
    import torch

    nll = [x for r in run["nll"] for x in r]
    kl = torch.tensor([x for r in run["kl"] for x in r], dtype=torch.float64)
    ref_nll = [x for r in ref["nll"] for x in r]
    ppl, ref_ppl = math.exp(sum(nll) / len(nll)), math.exp(sum(ref_nll) / len(ref_nll))
    top1 = [x for r in run["top1"] for x in r]
    return {"ppl": ppl, "delta_ppl": ppl - ref_ppl, "kl_mean": float(kl.mean()),
            "kl_p999": float(torch.quantile(kl, 0.999)) if kl.numel() > 1 else float(kl.max()),
            "top1_agree": sum(top1) / len(top1), "tokens": len(nll)}


def verify(cfg: VerifyConfig, log=print, model=None) -> dict:
    """Run ``kvcal verify`` (module doc). Returns the ``kvcal-verify/1`` document; ``doc["passed"]`` is
    False when a served row fails ``--accept``, served ≠ predicted, or the scales were not applied."""
    import datetime as _dt

    from kvcal import __version__
    from kvcal.evaluate.accept import DEFAULT_ACCEPT, judge
    from kvcal.formats.vllm_dtypes import VllmDTypeError, check_backend_serves, vllm_backend
    from kvcal.vllm_plan import VllmKVPlan

    crit_str = cfg.accept or DEFAULT_ACCEPT[8]
    crit = check_accept(crit_str)
    engine_python = check_engine_python(cfg.engine_python)
    rec_tmp = None
    skip = tuple(cfg.skip_layers)
    if (Path(cfg.checkpoint) / "deploy.json").is_file() and not (Path(cfg.checkpoint) / "config.json").is_file():
        rec_tmp = tempfile.TemporaryDirectory(prefix="kvcal-verify-recommend-")
        path, rec_dtype, rec_skip = from_recommend(Path(cfg.checkpoint), cfg.model_dir, Path(rec_tmp.name), log)
        if cfg.kv_cache_dtype is not None and cfg.kv_cache_dtype != rec_dtype:
            raise KvcalError(f"--kv-cache-dtype {cfg.kv_cache_dtype}: the recommend output chose {rec_dtype}; drop "
                             "--kv-cache-dtype")
        ck, dtype, skip = read_checkpoint(path), rec_dtype, skip or rec_skip
    else:
        ck = read_checkpoint(cfg.checkpoint)
        dtype = cfg.kv_cache_dtype or ck.kv_cache_dtype
    if dtype is None:
        raise KvcalError(f"checkpoint {ck.path} has no kv_cache_scheme; pass --kv-cache-dtype (fp8 or fp8_e5m2) to "
                         "verify it at vLLM's default scales")
    if dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        raise KvcalError(f"--kv-cache-dtype {dtype}: verify checks the static-scale FP8 dtypes (fp8, fp8_e4m3, "
                         "fp8_e5m2)")
    if dtype == "fp8_e5m2" and any(s is not None for s in ck.k_scales):
        log("note: the checkpoint's scales were calibrated for e4m3; served here with fp8_e5m2 as vLLM would")
    backend = cfg.backend
    if backend is not None:
        try:
            backend = vllm_backend(backend).name
            check_backend_serves(backend, dtype, ck.head_dim)
        except VllmDTypeError as e:
            raise KvcalError(f"--backend: {e}") from None
    if backend in (None, "cpu"):
        why = cpu_fp8_support()
        if why is not None and backend == "cpu":
            raise KvcalError(f"vLLM's CPU backend cannot serve --kv-cache-dtype {dtype} here: {why}")
    if ck.num_layers < 1:
        raise KvcalError(f"{ck.path / 'config.json'}: no num_hidden_layers")
    bad = [i for i in skip if not 0 <= i < ck.num_layers]
    if bad or len(skip) >= ck.num_layers:
        raise KvcalError(f"--skip-layers {','.join(map(str, skip))}: the model has {ck.num_layers} layers (0 to "
                         f"{ck.num_layers - 1}) and at least one must stay in {dtype}")
    if any(s is None for s in ck.k_scales + ck.v_scales) and any(s is not None for s in ck.k_scales + ck.v_scales):
        missing = [i for i, (a, b) in enumerate(zip(ck.k_scales, ck.v_scales, strict=True)) if a is None or b is None]
        raise KvcalError(f"checkpoint {ck.path}: layers {missing[:8]} have no k_scale/v_scale while others do "
                         "(vLLM would serve them at 1.0); re-export the checkpoint")
    has_scales = all(s is not None for s in ck.k_scales + ck.v_scales)

    from kvcal.corpus import check_corpus
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.models import load_model, load_tokenizer

    corpus_opts = {"text_field": cfg.text_field, "messages_field": cfg.messages_field, "split": cfg.split}
    check_corpus(cfg.corpus, **corpus_opts)
    max_pos = ck.text_config.get("max_position_embeddings")
    if isinstance(max_pos, int) and cfg.context > max_pos:
        raise KvcalError(f"--context {cfg.context} exceeds the model's max_position_embeddings {max_pos}")
    with tempfile.TemporaryDirectory(prefix="kvcal-verify-") as td:
        work = Path(td)
        view = no_scale_view(ck, work / "no-scales")
        tok = load_tokenizer(str(view))
        ids, corpus_info = corpus_stream(cfg.corpus, tok, **corpus_opts)
        bos = served_bos(tok)  # as kvcal evaluate: a window starts with the BOS the tokenizer adds, if any
        wins = cut_windows(ids, cfg.context, cfg.windows, bos=bos)
        if len(wins) < 2:
            raise KvcalError(f"corpus {cfg.corpus} has {ids.numel()} tokens: fewer than 2 windows of {cfg.context} "
                             "(use a longer corpus or a smaller --context)")
        sk = [str(i) for i in skip]
        runs = [{"name": "16-bit", "model_dir": str(view), "kv_cache_dtype": "auto"}]
        if has_scales:
            runs.append({"name": f"{dtype} checkpoint scales", "model_dir": os.path.abspath(ck.path), "kv_cache_dtype": dtype,
                         "skip_layers": sk})
        runs.append({"name": f"{dtype} scales 1.0", "model_dir": str(view), "kv_cache_dtype": dtype, "skip_layers": sk})
        log(f"engine: {len(runs)} runs x {len(wins)} windows x {cfg.context} tokens in {engine_python}")
        served = run_engine(engine_python, {"windows": wins.tolist(), "max_model_len": cfg.context, "dtype": "float32",
                                            "runs": runs, "reference": "16-bit", "top_k": 5}, work, cfg.timeout_s)
        impls = {i for r in served["runs"].values() for i in r.get("attention_impl", [])}
        engine_backend = next((IMPL_BACKEND[i] for i in impls if i in IMPL_BACKEND), "cuda")
        if backend is not None and backend != engine_backend:
            raise KvcalError(f"--backend {backend}, but the engine ran {', '.join(sorted(impls))} ({engine_backend}); "
                             "drop --backend or pass the engine's")
        backend = engine_backend
        align = max(r["align_max_abs"] for r in served["runs"].values())
        if not align <= ALIGN_TOL:
            raise KvcalError(f"the observed engine logits reproduce its served log-probabilities only to {align:.3g} "
                             f"nats (> {ALIGN_TOL}); this vLLM computes prompt log-probabilities differently")
        log(f"kvcal prediction: backend {backend}, {len(wins)} windows")
        if model is None:
            model = load_model(str(view))
        L = ck.num_layers
        plans = {}
        qs = ck.q_scales if all(s is not None for s in ck.q_scales) else None  # read only where queries are FP8
        # the engine's backend, and (for a backend that truncates) the same cache written by rounding to nearest with
        # the queries left unquantized: the write path alone, what truncation costs
        for alt in dict.fromkeys([backend, "cuda"]):
            qq = None if alt == backend else False
            if has_scales:
                plans[(f"{dtype} checkpoint scales", alt)] = VllmKVPlan(
                    dtype, L, k_scales=ck.k_scales, v_scales=ck.v_scales, q_scales=qs, backend=alt, quantize_query=qq,
                    skip_layers=skip)
            plans[(f"{dtype} scales 1.0", alt)] = VllmKVPlan(dtype, L, backend=alt, quantize_query=qq,
                                                             skip_layers=skip)
        pred = predict(model, wins, {f"{n}@{b}": p for (n, b), p in plans.items()})
    if rec_tmp is not None:
        rec_tmp.cleanup()
    rows = []
    s_ref, p_ref = served["runs"]["16-bit"], pred["16-bit"]
    ref_served, ref_pred = summarize(s_ref, s_ref), summarize(p_ref, p_ref)
    ppl16 = ref_served["ppl"]
    floor_ppl = abs(ref_served["ppl"] - ref_pred["ppl"])
    scale_check = []
    for r in runs[1:]:
        name = r["name"]
        s_run, p_run = served["runs"][name], pred[f"{name}@{backend}"]
        srv, prd = summarize(s_run, s_ref), summarize(p_run, p_ref)
        # paired per-window differences: log-PPL changes (ΔPPL ≈ PPL16 · Δ log PPL) and mean KL
        dl_s = [a - b for a, b in zip(_window_means(s_run["nll"]), _window_means(s_ref["nll"]), strict=True)]
        dl_p = [a - b for a, b in zip(_window_means(p_run["nll"]), _window_means(p_ref["nll"]), strict=True)]
        ag_ppl = agreement([ppl16 * x for x in dl_s], [ppl16 * x for x in dl_p], floor_ppl)
        ag_ppl["diff"] = srv["delta_ppl"] - prd["delta_ppl"]
        ag_ppl["ok"] = abs(ag_ppl["diff"]) <= ag_ppl["tol"]
        ag_kl = agreement(_window_means(s_run["kl"]), _window_means(p_run["kl"]))
        status, failed = judge(srv, crit)
        row = {"run": name, "kv_cache_dtype": dtype, "scales": "checkpoint" if "checkpoint" in name else "1.0",
               "skip_layers": list(skip),
               "served": srv, "predicted": prd, "backend": backend, "ppl_agreement": ag_ppl, "kl_agreement": ag_kl,
               "accept": status, "failed": failed, "agree": ag_ppl["ok"] and ag_kl["ok"]}
        if backend != "cuda":
            alt = summarize(pred[f"{name}@cuda"], p_ref)
            row["predicted_if_rounding"] = alt
        rows.append(row)
        held = s_run["layer_scales"]
        if "checkpoint" in name:
            bad = [i for i, x in enumerate(held) if i < L and not (
                math.isclose(x["k_scale"], ck.k_scales[i], rel_tol=2 ** -23) and
                math.isclose(x["v_scale"], ck.v_scales[i], rel_tol=2 ** -23))]
            scale_check.append({"what": "every layer's loaded k_scale/v_scale equals the checkpoint's",
                                "ok": not bad and len(held) == L, "layers_differing": bad})
        if skip:
            kept = [i for i, x in enumerate(held) if (i in skip) != (x["kv_cache_dtype"] == "auto")]
            scale_check.append({"what": f"{name}: layers {','.join(map(str, skip))} (and only they) hold a 16-bit cache",
                                "ok": not kept, "layers_differing": kept})
    if has_scales:
        a, b = rows[0]["served"], rows[1]["served"]
        differs = a["ppl"] != b["ppl"] or a["kl_mean"] != b["kl_mean"]
        scale_check.append({"what": "the served run with the checkpoint's scales differs from the same dtype at 1.0",
                            "ok": differs})
    passed = all(r["accept"] == "PASS" and r["agree"] for r in rows) and all(c["ok"] for c in scale_check)
    return {
        "schema": "kvcal-verify/1", "kvcal_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": passed, "checkpoint": str(ck.path), "engine": {
            "python": str(engine_python), "vllm_version": served.get("vllm_version"),
            "torch_version": served.get("torch_version"), "attention_impl": sorted(impls), "backend": backend,
            "align_max_abs": align, "seconds": {n: {"start": r["engine_start_s"], "serve": r["serve_s"]}
                                               for n, r in served["runs"].items()}},
        "corpus": {**corpus_info, "context": cfg.context, "windows": len(wins),
                   "bos_token_id": bos,
                   "window_source": "as kvcal evaluate: consecutive windows from the start, "
                                    + ("each starting with the BOS the tokenizer adds" if bos is not None else
                                       "no BOS (the tokenizer adds none)")},
        "reference": {"served_16bit_ppl": ref_served["ppl"], "predicted_16bit_ppl": ref_pred["ppl"]},
        "accept": crit_str, "confidence": CONFIDENCE, "rows": rows, "scales_applied": scale_check,
    }


def render(doc: dict) -> str:
    """The one table ``kvcal verify`` prints (plus its verdict lines)."""
    e = doc["engine"]
    lines = [f"engine: vLLM {e['vllm_version']} ({', '.join(e['attention_impl'])}; kvcal backend {e['backend']}), "
             f"{doc['corpus']['windows']} x {doc['corpus']['context']} tokens of {doc['corpus']['path']}; "
             + (f"layers {','.join(map(str, doc['rows'][0]['skip_layers']))} in the model dtype; "
                if doc["rows"] and doc["rows"][0].get("skip_layers") else "")
             + f"16-bit PPL served {doc['reference']['served_16bit_ppl']:.4f}, kvcal {doc['reference']['predicted_16bit_ppl']:.4f}",
             "",
             "| --kv-cache-dtype | scales | served ΔPPL | predicted | diff (tol) | served KL | predicted | diff (tol) "
             f"| bar {doc['accept']} | served = predicted |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in doc["rows"]:
        s, p, a, k = r["served"], r["predicted"], r["ppl_agreement"], r["kl_agreement"]
        lines.append(f"| {r['kv_cache_dtype']} | {r['scales']} | {s['delta_ppl']:+.4f} | {p['delta_ppl']:+.4f} | "
                     f"{a['diff']:+.4f} (±{a['tol']:.4f}) | {s['kl_mean']:.3e} | {p['kl_mean']:.3e} | "
                     f"{k['diff']:+.2e} (±{k['tol']:.2e}) | {r['accept']}"
                     f"{' (' + '; '.join(r['failed']) + ')' if r['failed'] else ''} | {'PASS' if r['agree'] else 'FAIL'} |")
    for r in doc["rows"]:
        if "predicted_if_rounding" in r:
            q = r["predicted_if_rounding"]
            lines.append(f"note: {r['run']}: written by rounding to nearest (the GPU kernels' write, queries "
                         "unquantized), kvcal predicts "
                         f"ΔPPL {q['delta_ppl']:+.4f}, KL {q['kl_mean']:.3e}; truncation costs "
                         f"{r['predicted']['kl_mean'] / max(q['kl_mean'], 1e-30):.2f}x the KL of rounding here")
    for c in doc["scales_applied"]:
        lines.append(f"scales applied: {c['what']}: {'yes' if c['ok'] else 'NO'}")
    lines.append(f"tolerance: {int(doc['confidence'] * 100)}% paired t-interval over windows (+ the 16-bit "
                 "disagreement for ΔPPL); docs/serving.md#served-vs-predicted")
    lines.append("verify: " + ("PASS" if doc["passed"] else "FAIL"))
    return "\n".join(lines)


__all__ = ["VerifyConfig", "verify", "render", "agreement", "read_checkpoint", "no_scale_view", "run_engine",
           "cpu_fp8_support", "check_engine_python", "VERIFY_METRICS"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: kvcal verify --help")

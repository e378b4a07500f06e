"""Serve token windows in a real vLLM and return per-token figures (runs in the engine's own Python).

This file is executed by the engine's interpreter (``kvcal verify --engine-python PATH``), never
imported by kvcal: it imports only the standard library, torch and vllm. Input: a JSON request
(``argv[1]``); output: a JSON result (``argv[2]``). A refusal by the engine (a dtype this CPU or
backend cannot serve, a model it cannot load) is written as ``{"error": "<one line>"}`` with exit
status 3.

Request::

    {"windows": [[token ids], ...],            # N windows of T tokens each
     "max_model_len": T, "dtype": "float32",
     "runs": [{"name": "16-bit", "model_dir": DIR, "kv_cache_dtype": "auto",
               "label": "what DIR is, for messages"},          # optional: default DIR
              {"name": "fp8", "model_dir": DIR, "kv_cache_dtype": "fp8",
               "skip_layers": ["0", "29"]}, ...],          # optional: --kv-cache-dtype-skip-layers
     "reference": "16-bit", "top_k": 5,
     "chunk_rows": 256, "scratch_dir": DIR}    # optional: positions per chunk; where the reference rows go

Each run starts ``vllm.LLM`` (in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and asks for
``prompt_logprobs`` of every window (``SamplingParams(max_tokens=1, prompt_logprobs=top_k)``). The
full-vocabulary logits vLLM computes for those prompt positions are observed by a forward hook on
the model's ``logits_processor`` (the module whose output vLLM's sampler turns into the served
log-probabilities; the hook reads, it changes nothing); the served ``prompt_logprobs`` of each
target token are compared with ``log_softmax`` of the observed rows (``align_max_abs``) so the
rows are proven to be the served ones. Per run and window: NLL of every target token (nats), and
against the reference run the per-position ``KL(P_ref ‖ P_run)`` (nats, float64 over the full
vocabulary) and top-1 agreement. Also per run: the static ``k_scale``/``v_scale`` every attention
layer holds after loading (``_k_scale_float``/``_v_scale_float``), the attention backend, timings and the
process's peak resident memory so far.

Memory: one window's observed logit rows (float32 ``[T, V]``) plus one chunk of ``chunk_rows`` positions in
float64. The reference run's log-probabilities are written (float32, as computed) to a scratch file in
``scratch_dir`` (default: the result's folder), read back chunk by chunk for the KL of the later runs, and
removed at exit; the figures are the same as holding them in memory (every operation is row-wise).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def _fail(out: str, msg: str) -> None:
    with open(out, "w") as f:
        json.dump({"error": " ".join(str(msg).split())}, f)
    sys.exit(3)


def _layer_scales(model) -> list:
    rows = []
    for name, m in model.named_modules():
        if hasattr(m, "_k_scale_float") and hasattr(m, "kv_cache_dtype"):
            rows.append({"layer": name, "k_scale": float(m._k_scale_float), "v_scale": float(m._v_scale_float),
                         "kv_cache_dtype": str(m.kv_cache_dtype)})
    return rows


#: positions per chunk when turning a window's logit rows into log-probabilities and KL terms: 256 rows of a
#: 262,144-token vocabulary are 512 MiB in float64, the largest transient the runner holds besides the rows
CHUNK_ROWS = 256


def _chunks(n: int, size: int):
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _logp(rows, o: int, a: int, b: int):
    """float64 log-softmax of logit rows ``o+a .. o+b-1`` (row-wise: the same values as over all rows at once)."""
    import torch

    return torch.log_softmax(rows[o + a:o + b].double(), -1)


def _read_rows(path: str, offset: int, a: int, b: int, vocab: int):
    """Rows ``a .. b-1`` (float32 ``[b-a, vocab]``) of the window written at byte ``offset`` of ``path``."""
    import numpy as np
    import torch

    arr = np.fromfile(path, dtype=np.float32, count=(b - a) * vocab, offset=offset + a * vocab * 4)
    return torch.from_numpy(arr.reshape(b - a, vocab))


def _peak_rss_mib() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _cpu_fp8_refusal(torch, dtypes: list) -> str | None:
    """vLLM-CPU's own condition for an FP8 cache (``cpu_attn.py`` ``_get_attn_isa``: AVX-512 or AMX on x86), checked
    up front; ``None`` where it holds, on other platforms, or when no run asks for FP8. Its AVX2 build has no FP8
    attention kernel (measured: past the Python check it stops with "Unsupported CPU attention configuration")."""
    if not any(str(d).startswith("fp8") for d in dtypes):
        return None
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or not hasattr(torch.cpu, "_is_avx512_supported"):
            return None
        if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
            return None
    except Exception:
        return None
    return "this CPU has neither AVX-512 nor AMX (vLLM-CPU serves FP8 only with one of them; its AVX2 build has no " \
           "FP8 attention kernel)"


def _engine_message(e: BaseException) -> str:
    """``"<exception type>: <message>"`` of the root cause of ``e``, the engine's own words on what it refused: for a
    configuration error (pydantic's ``ValidationError``, whose text ends in a link to pydantic's documentation
    after a dump of every argument) its errors' messages; else the last line of its text that is not such a link."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    name = type(root).__name__
    try:
        errors = root.errors() if callable(getattr(root, "errors", None)) else None
        msgs = [" ".join(str(x.get("msg", "")).split()) for x in errors or () if isinstance(x, dict)]
    except Exception:  # not pydantic's errors(): read the text below
        msgs = []
    msgs = [m[len("Value error, "):] if m.startswith("Value error, ") else m for m in msgs if m]
    if msgs:
        return f"{name}: {'; '.join(msgs)}"
    lines = [ln.strip() for ln in (str(root).strip() or str(e)).splitlines()
             if ln.strip() and not ln.strip().startswith("For further information visit")]
    return f"{name}: {lines[-1]}" if lines else name


def main(req_path: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(req_path) as f:
        req = json.load(f)
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as e:  # not an engine interpreter
        _fail(out_path, f"cannot import vllm in this Python ({type(e).__name__}: {e})")
    why = _cpu_fp8_refusal(torch, [r["kv_cache_dtype"] for r in req["runs"]])
    if why:  # before the 16-bit run, not minutes into the request
        _fail(out_path, f"vLLM {vllm.__version__} cannot serve an FP8 KV cache here: {why}")
    windows = req["windows"]
    top_k = int(req.get("top_k", 5))
    chunk = max(1, int(req.get("chunk_rows", CHUNK_ROWS)))
    result = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "runs": {}}
    captured: list = []

    def hook(_module, _inputs, output):
        captured.append(output.detach().to(torch.float32).cpu().clone())

    # the reference run's log-probabilities (float32 [T-1, V] per window) go to a scratch file beside the result,
    # removed at exit, and are read back one chunk of positions at a time: memory stays O(one window's logits)
    # whatever the vocabulary (Gemma 3: 262,144 x 1,023 x 4 B = 1.07 GB per window, 8.6 GB for 8 windows)
    fd, ref_path = tempfile.mkstemp(prefix="kvcal-ref-logp-", suffix=".f32",
                                    dir=req.get("scratch_dir") or os.path.dirname(os.path.abspath(out_path)))
    os.close(fd)
    ref_offsets: list = []  # byte offset of each window's rows in ref_path
    try:
        for run in req["runs"]:
            t0 = time.perf_counter()
            try:
                extra = {"kv_cache_dtype_skip_layers": list(run["skip_layers"])} if run.get("skip_layers") else {}
                llm = LLM(model=run["model_dir"], dtype=req.get("dtype", "float32"),
                          kv_cache_dtype=run["kv_cache_dtype"], enforce_eager=True,
                          max_model_len=int(req["max_model_len"]) + 1, max_logprobs=top_k, skip_tokenizer_init=True,
                          seed=0, max_num_seqs=1, **extra)
            except Exception as e:
                _fail(out_path, f"vLLM {vllm.__version__} cannot serve {run.get('label') or run['model_dir']} with "
                                f"--kv-cache-dtype {run['kv_cache_dtype']}: {_engine_message(e)}")
            start_s = time.perf_counter() - t0
            handles = llm.apply_model(lambda m: m.logits_processor.register_forward_hook(hook))
            scales = llm.apply_model(_layer_scales)[0]
            backend = llm.apply_model(lambda m: sorted({type(getattr(x, "impl", None)).__name__
                                                        for _, x in m.named_modules() if hasattr(x, "_k_scale_float")}))[0]
            sp = SamplingParams(max_tokens=1, prompt_logprobs=top_k, temperature=0.0)
            is_ref = run["name"] == req["reference"]
            nll, kl, top1, align = [], [], [], 0.0
            t1 = time.perf_counter()
            for wi, w in enumerate(windows):
                captured.clear()
                out = llm.generate([{"prompt_token_ids": list(map(int, w))}], sp, use_tqdm=False)[0]
                starts, c = [], 0
                for t in captured:
                    starts.append(c)
                    c += t.shape[0]
                rows = captured[0] if len(captured) == 1 else torch.cat(captured, 0) if captured else torch.zeros(0)
                captured.clear()  # one copy of this window's logits from here on
                n = len(w) - 1
                if rows.dim() != 2 or rows.shape[0] < n:
                    _fail(out_path, f"observed {tuple(rows.shape)} logit rows for a {len(w)}-token prompt; expected "
                                    f"at least {n} (this vLLM computes prompt log-probabilities differently)")
                tgt = torch.tensor(w[1:], dtype=torch.long)
                served = torch.tensor([out.prompt_logprobs[i + 1][int(w[i + 1])].logprob for i in range(n)],
                                      dtype=torch.float64)
                # the sampling step's row(s) and the prompt rows arrive in separate calls, in an order this
                # vLLM chooses: take the n consecutive rows (starting at a call boundary) whose log-softmax
                # reproduces the served prompt log-probabilities
                best = None
                for o in starts:
                    if o + n > rows.shape[0]:
                        continue
                    err = max(float((served[a:b] - _logp(rows, o, a, b).gather(-1, tgt[a:b, None])[:, 0]).abs().max())
                              for a, b in _chunks(n, chunk))
                    if best is None or err < best[0]:
                        best = (err, o)
                if best is None:
                    _fail(out_path, f"no {n} consecutive logit rows observed for a {len(w)}-token prompt")
                align = max(align, best[0])
                o = best[1]
                if is_ref:
                    ref_offsets.append(os.path.getsize(ref_path))
                w_nll, w_kl, w_top1 = [], [], []
                for a, b in _chunks(n, chunk):
                    logp = _logp(rows, o, a, b)  # positions a..b-1 predict tokens a+1..b
                    w_nll += (-logp.gather(-1, tgt[a:b, None])[:, 0]).tolist()
                    if is_ref:
                        with open(ref_path, "ab") as f:
                            f.write(logp.to(torch.float32).numpy().tobytes())
                        w_kl += [0.0] * (b - a)
                        w_top1 += [1] * (b - a)
                    else:
                        lr = _read_rows(ref_path, ref_offsets[wi], a, b, logp.shape[-1]).double()
                        w_kl += (lr.exp() * (lr - logp)).sum(-1).tolist()
                        w_top1 += (lr.argmax(-1) == logp.argmax(-1)).int().tolist()
                del rows
                nll.append(w_nll)
                kl.append(w_kl)
                top1.append(w_top1)
            for h in handles:
                h.remove()
            result["runs"][run["name"]] = {
                "kv_cache_dtype": run["kv_cache_dtype"], "model_dir": run["model_dir"], "nll": nll, "kl": kl,
                "top1": top1, "align_max_abs": align, "layer_scales": scales, "attention_impl": backend,
                "engine_start_s": round(start_s, 2), "serve_s": round(time.perf_counter() - t1, 2),
                "peak_rss_mib": _peak_rss_mib()}
            del llm
            import gc

            gc.collect()
    finally:
        try:
            os.unlink(ref_path)
        except OSError:
            pass
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python runner.py REQUEST.json RESULT.json")
    main(sys.argv[1], sys.argv[2])

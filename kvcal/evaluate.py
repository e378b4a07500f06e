"""Model-level evaluation of a KV quantization plan (Protocol A: teacher-forced, fake-quant).

Protocol A (``shared/docs/prior-art.md``, "Evaluation conventions"): one forward pass per window
with **every** key and value that attention reads quantized-dequantized by the plan (through the
same attention hook as capture), compared with the unquantized model on the same window:

* perplexity ``exp(mean NLL)`` over the ``T - 1`` predicted tokens of each window (nats);
* ``KL(P_16bit ‖ P_quant)`` of the next-token distribution at every predicted position: mean and
  99.9th percentile (nats);
* top-1 agreement: fraction of positions whose argmax token is the same.

Decode mode (:func:`decode_eval`): what a server does. Each window ``[T]`` is split into a prefill
of ``P = T - decode_tokens`` tokens written through :class:`kvcal.runtime.QuantizedKVCache` in one
call, then the remaining tokens are fed **one at a time** through the same cache (teacher-forced
inputs); the ``decode_tokens`` next-token distributions (positions ``P-1 .. T-2``) are compared
with the unquantized model (fp32 ``DynamicCache``) on the same positions. Greedy agreement: from
the prefill state, both generate ``greedy_tokens`` tokens greedily; ``greedy_agree`` is the
fraction of sequences whose tokens are all identical, ``greedy_prefix`` the mean identical-prefix
length over ``greedy_tokens``. Windows are decoded ``batch`` at a time (one cache of batch B).

``kvcal evaluate`` (:func:`evaluate`) runs both modes for the artifact and the baselines at every
context, writes the JSON below and returns it; ``doc["passed"]`` is False when any row of the
artifact under test fails its acceptance criteria (the CLI exits 1).

JSON schema ``"kvcal-eval/1"`` (keys are stable; all losses in nats, bytes are exact integers)::

    {
      "schema": "kvcal-eval/1",
      "kvcal_version": str, "created": ISO-8601 str, "passed": bool, "exit_code": 0 | 1,
      "artifact": {"path": str, "kv": <artifact metadata "kv" section>, "calibration": {...} | null,
                   "corpus": {...} | null, "sha256": sha256 of its kv_scales.safetensors},
      "model": <artifact-style model section: id, config_sha256, num_layers, num_kv_heads, head_dim,
                max_position_embeddings, weight_precision, ...>,
      "corpus": {"path", "sha256", "kind": "txt" | "jsonl" | "parquet" | "arrow" | "csv" | "json" |
                 "save_to_disk" | "data_dir" | "hub", "tokens": total tokens in the stream,
                 "windows": {"<context>": number of windows}, "window_source": str,
                 "eval_tokens": {"<context>": predicted positions per mode}},
      "regimes": [{"context": int, "batch": int}, ...],
      "methods": {name: {"role": "artifact" | "reference" | "baseline", "label": str,
                         "k": spec dict | null, "v": spec dict | null, "residual_window": int,
                         "sink_tokens": int, "quantized_tensors": ["k", "v"], "bits": int,
                         "criteria": str}
                  — and for ``--vllm-dtype D`` rows ``"vllm:D"``: {"role": "vllm", "engine": "vllm",
                  "kv_cache_dtype", "skip_layers", "query_quantization", "k_scale", "v_scale",
                  "q_scale", "label", "bits", "criteria"} (teacher-forced rows only)},
      "results": [{"method": str, "mode": "teacher_forced" | "decode", "context": int, "batch": int,
                   "ppl": float, "delta_ppl": float, "kl_mean": float, "kl_p999": float,
                   "top1_agree": float, "greedy_agree": float | null, "greedy_prefix": float | null,
                   "tokens": int, "windows": int, "seconds": float,
                   "status": "PASS" | "FAIL" | "REFERENCE", "criteria": str, "failed": [str]}],
      "per_layer": {method: {"k_attention_kl": [float per layer] (mean KL per query, nats),
                             "v_output_error": [float per layer] (relative ||P(V^-V)||^2/||PV||^2),
                             "tokens": int, "queries": int}},
      "memory": {"bytes_per_token": {method: float}, "bytes_per_token_16bit": int,
                 "cache_bytes": {method: [{"context", "batch", "bytes", "vs_16bit"}]},
                 "measured": [{"method", "context", "batch", "cache_tokens", "allocated_bytes",
                               "expected_bytes"}]},
      "description": {"quantized_tensors": {method: [...]}, "formats": {method: str},
                      "weight_precision": str, "key_position": "post_rope", "device": str,
                      "throughput": str, "context_regimes": [int], "batch_regimes": [int],
                      "decode_tokens": int, "greedy_tokens": int},
      "notes": [str]
    }

``teacher_forced`` rows do not depend on the batch (batching changes no value); they are computed
once per context and reported with the largest batch regime that was used to run them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcal.capture.hooks import attention_hook


def text_windows(tokenizer, text: str, window: int, n_windows: int, skip_windows: int = 0) -> torch.Tensor:
    """Tokenize ``text`` at once (no BOS added) and cut consecutive ``window``-token windows.

    Returns int64 ``[n, window]`` with ``n <= n_windows`` (fewer if the text is short), starting
    after ``skip_windows`` windows (so calibration and evaluation windows can be kept apart).
    Matches the protocol of the baselines in ``shared/docs/prior-art.md``.
    """
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    start = skip_windows * window
    n = min(n_windows, max(0, (len(ids) - start) // window))
    return ids[start : start + n * window].view(n, window)


def plan_hook(plan) -> Callable:
    """Attention-hook callback that fake-quantizes K and V of every layer with ``plan``
    (a :class:`~kvcal.plan.KVPlan`), and the post-RoPE query too when the plan has
    ``fake_quant_query(layer, q, num_kv_heads)`` (:class:`~kvcal.vllm_plan.VllmKVPlan`: vLLM's
    FP8 query quantization)."""

    def cb(module, q, k, v, mask, kwargs):
        i = module.layer_idx
        if hasattr(plan, "fake_quant_query"):
            return plan.fake_quant_query(i, q, k.shape[1]), plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)
        return plan.fake_quant(i, "k", k), plan.fake_quant(i, "v", v)

    return cb


def side_only(plan, side: str, layer: int | None = None):
    """A view of ``plan`` that quantizes only ``side`` (``"k"`` or ``"v"``) — of every layer, for
    K-only/V-only splits, or of one ``layer`` (single-side sensitivity probes)."""

    class _One:
        def fake_quant(self, i, s, x):
            return plan.fake_quant(i, s, x) if s == side and layer in (None, i) else x

    return _One()


def side_sensitivity(model, samples: list[torch.Tensor], plan, progress: bool = True) -> dict[tuple[int, str], float]:
    """Model-level KL when only one layer's side is quantized, for every (layer, side) of ``plan``.

    ``samples``: int64 token ids, each ``[T_i]`` (held-out text; never the evaluation windows).
    ``plan``: a :class:`~kvcal.plan.KVPlan` (its ``sink_tokens`` apply). For each layer ``l`` and
    side ``s`` in ``"k"``, ``"v"`` the model runs teacher-forced with only that side of that layer
    fake-quantized (Protocol A), and the result is the mean over all predicted positions of
    ``KL(P_16bit ‖ P_quant)`` in nats (float64). Samples shorter than ``plan.sink_tokens + 2`` are
    skipped (no predicted position reads a quantized token there); ``ValueError`` when none is
    left. Cost: ``1 + 2·L`` forward passes per sample; memory: one ``[T, vocab]`` float64 pair. On the
    embedded model these single-side KLs add up to the all-sides KL within ~10%
    (``benchmarks/probe_int4.py``, 4-bit, 2 × 1024 tokens), which is what makes them usable as per-layer
    weights of a bit allocation (HAWQ-style sensitivity; KVTuner measures it the same way).
    """
    keys = [(layer, side) for layer in range(plan.num_layers) for side in ("k", "v")]
    return _mean_kl(model, samples, {key: side_only(plan, key[1], key[0]) for key in keys}, plan.sink_tokens + 2,
                    "sensitivity probe", progress,
                    f"side_sensitivity needs a sample of at least sink_tokens + 2 = {plan.sink_tokens + 2} tokens")


def plans_kl(model, samples: list[torch.Tensor], plans: dict, progress: bool = True) -> dict:
    """Model-level mean ``KL(P_16bit ‖ P_plan)`` in nats over every predicted position of
    ``samples``, for each plan of ``plans`` (any keys; values :class:`~kvcal.plan.KVPlan` or
    anything with ``fake_quant(layer, side, x)``), under Protocol A (every key and value attention
    reads is fake-quantized, sinks as the plan keeps them) — the ``kl_mean`` of
    :func:`teacher_forced`, for samples of different lengths.

    ``samples``: int64 token ids, each ``[T_i]`` (held-out text; never the evaluation windows);
    samples shorter than 2 tokens are skipped and ``ValueError`` is raised when none is left.
    Every plan is scored on the same positions, so the results compare directly. Cost:
    ``1 + len(plans)`` forward passes per sample. Used by ``kvcal calibrate`` to choose the sink
    count (:data:`kvcal.calibrate.SINK_CANDIDATES`) on held-out samples."""
    return _mean_kl(model, samples, plans, 2, "plan probe", progress, "plans_kl needs a sample of at least 2 tokens")


def _mean_kl(model, samples: list[torch.Tensor], plans: dict, min_len: int, desc: str, progress: bool,
             too_short: str) -> dict:
    """Mean ``KL(P_16bit ‖ P_plan)`` (nats, float64) over every predicted position of the samples of
    at least ``min_len`` tokens, for each plan (Protocol A); ``ValueError(too_short)`` when none is."""
    from tqdm.auto import tqdm

    kl_sum = dict.fromkeys(plans, 0.0)
    n = 0
    device = next(model.parameters()).device
    bar = tqdm(total=len(samples) * len(plans), desc=desc, disable=not progress)
    with torch.no_grad():
        for ids in samples:
            ids = ids.reshape(1, -1).to(device)
            if ids.shape[1] < min_len:
                bar.update(len(plans))
                continue
            logp_ref = torch.log_softmax(model(ids, use_cache=False).logits[:, :-1].double(), -1)
            n += ids.shape[1] - 1
            for name, plan in plans.items():
                with attention_hook(model, plan_hook(plan)):
                    logp = torch.log_softmax(model(ids, use_cache=False).logits[:, :-1].double(), -1)
                kl_sum[name] += float((logp_ref.exp() * (logp_ref - logp)).sum())  # float64: >= 0 up to rounding
                bar.update()
    bar.close()
    if n == 0:
        raise ValueError(too_short)
    return {k: v / n for k, v in kl_sum.items()}


class _Acc:
    def __init__(self):
        self.nll, self.n, self.top1 = 0.0, 0, 0
        self.kl: list[torch.Tensor] = []

    def add(self, logp_ref: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor):
        self.nll += float(-logp.gather(-1, targets[..., None]).sum())
        self.n += targets.numel()
        self.top1 += int((logp.argmax(-1) == logp_ref.argmax(-1)).sum())
        kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)  # [B, T-1]
        self.kl.append(kl.flatten().double())

    def result(self, ref_ppl: float | None) -> dict:
        ppl = math.exp(self.nll / max(self.n, 1))
        kl = torch.cat(self.kl) if self.kl else torch.zeros(1, dtype=torch.float64)
        out = {"ppl": ppl, "tokens": self.n, "kl_mean": float(kl.mean()),
               "kl_p999": float(torch.quantile(kl, 0.999)) if kl.numel() > 1 else float(kl.max()),
               "top1_agree": self.top1 / max(self.n, 1)}
        if ref_ppl is not None:
            out["delta_ppl"] = ppl - ref_ppl
        return out


def teacher_forced(
    model,
    windows: torch.Tensor,
    plans: dict[str, object],
    batch_size: int = 1,
    progress: bool = True,
) -> dict[str, dict]:
    """Protocol A for several plans on the same windows, in one run.

    ``windows``: int64 ``[N, T]``. ``plans``: name -> :class:`~kvcal.plan.KVPlan` (or anything
    with ``fake_quant(layer, side, x)``), ``None`` meaning the unquantized model. Returns name ->
    ``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "tokens"}`` and ``"16-bit"`` for the
    reference (KL 0). Units: nats; ``tokens`` = predicted positions ``N · (T − 1)``.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    accs = {name: _Acc() for name in plans}
    ref = _Acc()
    steps = [(i, name) for i in range(0, len(windows), batch_size) for name in [None, *plans]]
    bar = tqdm(total=len(steps), desc="evaluate", disable=not progress)
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            ids = windows[i : i + batch_size].to(device)
            targets = ids[:, 1:].cpu()
            logp_ref = torch.log_softmax(model(ids, use_cache=False).logits[:, :-1].float().cpu(), -1)
            ref.add(logp_ref, logp_ref, targets)
            bar.update()
            for name, plan in plans.items():
                if plan is None:
                    logp = logp_ref
                else:
                    with attention_hook(model, plan_hook(plan)):
                        logits = model(ids, use_cache=False).logits
                    logp = torch.log_softmax(logits[:, :-1].float().cpu(), -1)
                accs[name].add(logp_ref, logp, targets)
                bar.update()
    bar.close()
    ref_res = ref.result(None)
    out = {"16-bit": {**ref_res, "delta_ppl": 0.0}}
    for name, acc in accs.items():
        out[name] = acc.result(ref_res["ppl"])
    return out


# ==== decode mode, baselines, acceptance, the `kvcal evaluate` driver =============================

SCHEMA = "kvcal-eval/1"
METRICS = ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree", "greedy_agree", "greedy_prefix")
_OPS = {"<=": lambda a, b: a <= b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b, ">": lambda a, b: a > b}

#: Default acceptance per precision (the mean payload bits of the plan's quantized sides, rounded
#: down to a key of this table: a ``--bits`` plan with one 2-bit layer among 4-bit ones is held to
#: the 4-bit bar, ``k4v2`` to the 3-bit one). The
#: 8-bit bar admits the FP8 floor of the embedded model (prior-art: unity +0.090 / 5.9e-3); the
#: 2-bit bar refuses KIVI-2 (+13 ppl there) — a configuration that went too far is a FAIL.
DEFAULT_ACCEPT = {
    16: "kl_mean<=1e-3,delta_ppl<=0.01",
    8: "kl_mean<=1e-2,delta_ppl<=0.15",
    4: "kl_mean<=3e-2,delta_ppl<=0.5",
    3: "kl_mean<=6e-2,delta_ppl<=1.0",
    2: "kl_mean<=1e-1,delta_ppl<=2.0",
}


def parse_accept(spec: str) -> list[tuple[str, str, float]]:
    """``"kl_mean<=2e-3,delta_ppl<=0.05"`` -> ``[("kl_mean", "<=", 0.002), ...]``.

    Metrics: see :data:`METRICS`; operators ``<= < >= >``. Raises :class:`~kvcal.errors.KvcalError`
    naming the bad clause."""
    import re

    from kvcal.errors import KvcalError

    out = []
    for clause in (c.strip() for c in spec.split(",")):
        if not clause:
            continue
        m = re.fullmatch(r"([a-z_0-9]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)", clause)
        if not m:
            raise KvcalError(f"--accept clause {clause!r} is not METRIC<=VALUE (e.g. kl_mean<=2e-3)")
        name, op, val = m.groups()
        if name not in METRICS:
            raise KvcalError(f"--accept metric {name!r} is unknown; choose from {', '.join(METRICS)}")
        try:
            out.append((name, op, float(val)))
        except ValueError:
            raise KvcalError(f"--accept clause {clause!r}: {val!r} is not a number") from None
    if not out:
        raise KvcalError("--accept is empty; give at least one clause like kl_mean<=2e-3")
    return out


def _quantized_bits(plan) -> list[int]:
    """Payload bits of every quantized (layer, side) of ``plan``."""
    if hasattr(plan, "quantized_bits"):  # a VllmKVPlan
        return plan.quantized_bits()
    return [sp.spec.bits for lp in plan.layers for sp in (lp.k, lp.v) if sp.spec.is_quantized]


def plan_bits(plan) -> int:
    """Fewest payload bits among the plan's quantized sides (16 if nothing is quantized)."""
    bits = _quantized_bits(plan)
    return min(bits) if bits else 16


def default_accept(plan) -> str:
    """The :data:`DEFAULT_ACCEPT` bar for ``plan``: by the mean payload bits over its (layer, side)s
    that are quantized (16 when none is), rounded down to a bar (2 at least)."""
    bits = _quantized_bits(plan)
    b = sum(bits) / len(bits) if bits else 16
    return DEFAULT_ACCEPT[max(k for k in DEFAULT_ACCEPT if k <= b)] if b >= 2 else DEFAULT_ACCEPT[2]


def judge(row: dict, criteria: list[tuple[str, str, float]]) -> tuple[str, list[str]]:
    """``("PASS"|"FAIL", failed clauses)``; a metric that is missing or NaN fails its clause."""
    failed = []
    for name, op, val in criteria:
        x = row.get(name)
        if x is None or not isinstance(x, (int, float)) or math.isnan(x) or not _OPS[op](x, val):
            failed.append(f"{name}={x if x is None else f'{x:.4g}'} not {op} {val:g}")
    return ("FAIL" if failed else "PASS"), failed


# ---- decode mode ---------------------------------------------------------------------------------

def _greedy(model, cache, first: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation ``[B, n]`` starting with ``first [B]`` (already chosen) through ``cache``."""
    toks = [first]
    for _ in range(n - 1):
        logits = model(toks[-1][:, None], cache=cache, use_cache=True).logits[:, -1]
        toks.append(logits.argmax(-1))
    return torch.stack(toks, 1).cpu()


def decode_eval(
    model,
    windows: torch.Tensor,
    plans: dict[str, object],
    batch: int = 1,
    decode_tokens: int = 128,
    greedy_tokens: int = 32,
    progress: bool = True,
    measure: list | None = None,
) -> dict[str, dict]:
    """Decode-mode figures for several plans (module docstring), plus ``"16-bit"`` (the unquantized
    model through ``DynamicCache``).

    ``windows`` int64 ``[N, T]``; ``plans`` name -> :class:`~kvcal.plan.KVPlan`; ``batch`` windows
    share one cache. Returns name -> ``{"ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree",
    "greedy_agree", "greedy_prefix", "tokens"}`` (``tokens`` = N · decode_tokens). ``measure``: a
    list receiving ``{"method", "cache_tokens", "allocated_bytes", "expected_bytes"}`` per plan
    (last chunk) — the runtime's measured allocation. Raises ``ValueError`` if ``T < 2``.
    """
    import copy

    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from kvcal.runtime import QuantizedKVCache

    N, T = windows.shape
    if T < 2:
        raise ValueError("decode mode needs windows of at least 2 tokens")
    nd = max(1, min(decode_tokens, T - 1))
    P = T - nd
    G = max(0, min(greedy_tokens, 4096))
    device = next(model.parameters()).device
    ref, accs = _Acc(), {name: _Acc() for name in plans}
    g_same = {name: [] for name in plans}
    g_prefix = {name: [] for name in plans}
    bar = tqdm(total=len(range(0, N, batch)) * (1 + len(plans)), desc=f"decode T={T} B={batch}", disable=not progress)
    with torch.no_grad():
        for i in range(0, N, batch):
            ids = windows[i : i + batch].to(device)
            targets = ids[:, P:].cpu()  # [b, nd]
            rc = DynamicCache(config=model.config)
            out = model(ids[:, :P], cache=rc, use_cache=True)
            first_logits = out.logits[:, -1:].float()
            gen_ref = _greedy(model, copy.deepcopy(rc), first_logits[:, -1].argmax(-1), G) if G else None
            if nd > 1:
                rest = model(ids[:, P : T - 1], cache=rc, use_cache=True).logits.float()
                ref_logits = torch.cat([first_logits, rest], 1)
            else:
                ref_logits = first_logits
            logp_ref = torch.log_softmax(ref_logits.cpu(), -1)  # [b, nd, V]
            ref.add(logp_ref, logp_ref, targets)
            del rc, out
            bar.update()
            for name, plan in plans.items():
                cache = QuantizedKVCache(plan, model.config)
                logits = model(ids[:, :P], cache=cache, use_cache=True).logits[:, -1].float()
                if G:
                    gen = _greedy(model, copy.deepcopy(cache), logits.argmax(-1), G)
                    same = gen == gen_ref
                    g_same[name].extend(same.all(1).tolist())
                    pref = torch.where(same.all(1), torch.full((same.shape[0],), G),
                                       (~same).int().argmax(1))
                    g_prefix[name].extend((pref.float() / G).tolist())
                acc = accs[name]
                acc.add(logp_ref[:, :1], torch.log_softmax(logits.cpu(), -1)[:, None], targets[:, :1])
                for j, t in enumerate(range(P, T - 1), start=1):
                    lg = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1].float()
                    acc.add(logp_ref[:, j : j + 1], torch.log_softmax(lg.cpu(), -1)[:, None], targets[:, j : j + 1])
                if measure is not None and i + batch >= N:
                    measure.append({"method": name, "cache_tokens": cache.get_seq_length(),
                                    "batch": int(ids.shape[0]), "allocated_bytes": cache.allocated_bytes(),
                                    "expected_bytes": cache.expected_bytes()})
                del cache
                bar.update()
    bar.close()
    ref_res = ref.result(None)
    res = {"16-bit": {**ref_res, "delta_ppl": 0.0, "greedy_agree": 1.0 if G else None,
                      "greedy_prefix": 1.0 if G else None}}
    for name, acc in accs.items():
        r = acc.result(ref_res["ppl"])
        r["greedy_agree"] = sum(g_same[name]) / len(g_same[name]) if G else None
        r["greedy_prefix"] = sum(g_prefix[name]) / len(g_prefix[name]) if G else None
        res[name] = r
    return res


# ---- per-layer attention errors -------------------------------------------------------------------

def per_layer_errors(model, ids: torch.Tensor, plans: dict[str, object], max_queries: int = 128) -> dict:
    """Per-layer attention KL for keys and attention-output error for values on one window.

    ``ids`` int64 ``[1, T]``. Captures post-RoPE q/k/v, then per layer and plan quantizes K (resp.
    V) alone as Protocol A does and scores it with :class:`~kvcal.search.objectives.SequenceCache`
    (``max_queries`` evenly spaced queries). Returns name -> ``{"k_attention_kl": [L] (mean KL per
    (query head, query), nats), "v_output_error": [L] (relative), "tokens", "queries"}``."""
    from kvcal.capture.hooks import attention_scaling, capture_kv
    from kvcal.search.objectives import SequenceCache

    captured: dict[int, tuple] = {}

    def on_layer(i, q, k, v, module):
        captured[i] = (q[0].float().cpu(), k[0].float().cpu(), v[0].float().cpu(),
                       attention_scaling(module, k.shape[-1]))

    with torch.no_grad(), capture_kv(model, on_layer):
        model(ids.to(next(model.parameters()).device), use_cache=False)
    out = {name: {"k_attention_kl": [], "v_output_error": [], "tokens": int(ids.shape[1]), "queries": 0}
           for name in plans}
    for i in sorted(captured):
        q, k, v, scaling = captured[i]
        sc = SequenceCache(q, k, v, scaling, max_queries)
        nq = sc.num_queries * k.shape[0]  # (query head, query) pairs
        for name, plan in plans.items():
            k_hat = plan.fake_quant(i, "k", k[None])[0]
            v_hat = plan.fake_quant(i, "v", v[None])[0]
            out[name]["k_attention_kl"].append(float(sc.key_kl(k_hat).sum()) / nq)
            err, norm = sc.value_error(v_hat)
            out[name]["v_output_error"].append(float(err.sum() / norm.sum().clamp_min(1e-30)))
            out[name]["queries"] = nq
    return out


# ---- baselines --------------------------------------------------------------------------------------

def fp8_plan(num_layers: int, scales: list[tuple[float, float]]):
    """Per-tensor FP8 e4m3 plan with the given ``(k_scale, v_scale)`` per layer."""
    from kvcal.formats.spec import preset
    from kvcal.plan import KVPlan

    plan = KVPlan.uniform(num_layers, preset("fp8"))
    for lp, (ks, vs) in zip(plan.layers, scales, strict=True):
        lp.k.scale = torch.tensor(float(ks)).reshape(1, 1, 1, 1)
        lp.v.scale = torch.tensor(float(vs)).reshape(1, 1, 1, 1)
    return plan


def artifact_amax(metadata: dict) -> list[tuple[float, float]] | None:
    """Per-layer ``(k_amax, v_amax)`` from a calibration artifact's ``layers[i][side]["amax"]``
    (max over heads), or ``None`` when the artifact does not record it."""
    layers = metadata.get("layers") or []
    n = int(metadata["model"]["num_layers"])
    if len(layers) != n:
        return None
    out = []
    for lm in layers:
        try:
            ka, va = (max(torch.as_tensor(lm[s]["amax"], dtype=torch.float64).flatten().tolist()) for s in ("k", "v"))
        except (KeyError, TypeError, ValueError):
            return None
        out.append((ka, va))
    return out


def capture_amax(model, windows: torch.Tensor, num_layers: int) -> list[tuple[float, float]]:
    """Per-layer ``(k_amax, v_amax)`` from a capture pass over ``windows`` ``[N, T]`` (use windows
    kept apart from the evaluation windows)."""
    from kvcal.capture.hooks import capture_kv

    amax = [[0.0, 0.0] for _ in range(num_layers)]

    def on_layer(i, q, k, v, module):
        amax[i][0] = max(amax[i][0], float(k.abs().max()))
        amax[i][1] = max(amax[i][1], float(v.abs().max()))

    with torch.no_grad(), capture_kv(model, on_layer):
        for w in windows:
            model(w[None].to(next(model.parameters()).device), use_cache=False)
    return [tuple(a) for a in amax]


def baseline_plans(num_layers: int, amax: list[tuple[float, float]] | None, kivi_window: int = 32) -> dict:
    """The side-by-side baselines: ``bf16-cache`` (16-bit storage through the runtime),
    ``fp8-unity``, ``fp8-absmax`` (calibration absmax / 448; omitted when ``amax`` is None),
    ``kivi4`` / ``kivi2`` (dynamic g32 asymmetric, K per-channel over 32 tokens, V per-token over
    32 channels, ``kivi_window`` recent tokens in 16 bits at run time)."""
    from kvcal.formats.fp8 import FP8_E4M3
    from kvcal.formats.spec import preset
    from kvcal.plan import KVPlan

    out = {"bf16-cache": KVPlan.uniform(num_layers, preset("bf16")),
           "fp8-unity": fp8_plan(num_layers, [(1.0, 1.0)] * num_layers)}
    if amax is not None:
        out["fp8-absmax"] = fp8_plan(num_layers, [(max(k, 1e-12) / FP8_E4M3.max, max(v, 1e-12) / FP8_E4M3.max)
                                                  for k, v in amax])
    for b in (4, 2):
        out[f"kivi{b}"] = KVPlan.uniform(num_layers, preset(f"kivi{b}", residual_window=kivi_window))
    return out


def describe_plan(plan) -> dict:
    """JSON description of a plan (layer 0 specs, per-layer ones when they differ)."""
    meta = plan.kv_metadata()
    lp = plan.layers[0]
    fmt = []
    for s, sp in (("K", lp.k), ("V", lp.v)):
        g = sp.spec.granularity
        gs = f"(g={g.group_size})" if hasattr(g, "group_size") else ""
        kind = "" if not sp.spec.is_quantized else (" dynamic" if sp.spec.dynamic else " static") + (
            "" if sp.spec.symmetric else " asym")
        fmt.append(f"{s} {sp.spec.format.value}" + ("" if not sp.spec.is_quantized else f" {g.name}{gs}{kind}"))
    return {"k": meta["k"], "v": meta["v"], "residual_window": plan.residual_window,
            "sink_tokens": plan.sink_tokens, "quantized_tensors": meta["quantized_tensors"],
            "bits": plan_bits(plan), "label": ", ".join(fmt),
            **({"layer_specs": meta["layer_specs"]} if "layer_specs" in meta else {})}


# ---- corpus windows ---------------------------------------------------------------------------------

def corpus_stream(path: str, tokenizer, text_field: str | None = None, messages_field: str | None = None,
                  split: str | None = None) -> tuple[torch.Tensor, dict]:
    """The evaluation token stream: a ``.txt`` file tokenized at once (no BOS; the prior-art
    protocol), or any other corpus :func:`kvcal.corpus.load_corpus` reads (JSONL, datasets; chat
    template applied; ``text_field``/``messages_field``/``split`` as there), its samples
    concatenated in file order. Returns ``(ids int64 [n], info)``; ``info["kind"]`` is ``txt`` or
    the corpus source (``jsonl``, ``parquet``, ...). Raises :class:`~kvcal.errors.KvcalError`."""
    import gzip
    import hashlib
    from pathlib import Path

    from kvcal.corpus import check_corpus, load_corpus

    p = Path(path)
    name = p.name.lower()
    if name.endswith((".txt", ".txt.gz")) and p.is_file():
        check_corpus(path, text_field=text_field, messages_field=messages_field, split=split)  # refuses the options
        raw = p.read_bytes()
        sha = hashlib.sha256(raw).hexdigest()
        text = (gzip.decompress(raw) if name.endswith(".gz") else raw).decode("utf-8", errors="replace")
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        kind = "txt"
    else:
        c = load_corpus(str(path), tokenizer, max_seq_len=1 << 20, text_field=text_field,
                        messages_field=messages_field, split=split)
        ids = torch.cat(c.samples) if c.samples else torch.zeros(0, dtype=torch.long)
        kind, sha = c.source, c.sha256
    return ids.long(), {"path": str(path), "sha256": sha, "kind": kind, "tokens": int(ids.numel())}


def cut_windows(ids: torch.Tensor, window: int, n: int, skip: int = 0) -> torch.Tensor:
    """Consecutive ``window``-token windows ``[<=n, window]`` after ``skip`` windows."""
    start = skip * window
    k = min(n, max(0, (ids.numel() - start) // window))
    return ids[start : start + k * window].view(k, window)


# ---- the driver ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalConfig:
    """Options of ``kvcal evaluate`` (defaults in one place). ``contexts``/``batches``: regimes;
    ``windows``: evaluation windows per context; ``decode_tokens``: positions decoded one at a
    time after the prefill; ``greedy_tokens``: greedy-agreement length (0 disables);
    ``accept``: criteria applied to every method (``None``: :data:`DEFAULT_ACCEPT` per precision);
    ``modes``: subset of ``("teacher_forced", "decode")``; ``per_layer_tokens``: window length of
    the per-layer error pass (0 disables)."""

    artifact: str
    corpus: str
    model: str | None = None
    contexts: tuple[int, ...] = (1024,)
    batches: tuple[int, ...] = (1,)
    windows: int = 8
    decode_tokens: int = 128
    greedy_tokens: int = 32
    baselines: bool = True
    accept: str | None = None
    modes: tuple[str, ...] = ("teacher_forced", "decode")
    per_layer_tokens: int = 1024
    kivi_window: int = 32
    device: str = "cpu"
    text_field: str | None = None  # corpus options, as kvcal.corpus.load_corpus
    messages_field: str | None = None
    split: str | None = None
    vllm_dtypes: tuple[str, ...] = ()  # vLLM --kv-cache-dtype values evaluated side by side (rows "vllm:<dtype>")

    def __post_init__(self):
        from kvcal.errors import KvcalError
        from kvcal.formats.vllm_dtypes import VllmDTypeError, vllm_dtype

        for d in self.vllm_dtypes:
            try:
                vllm_dtype(d)
            except VllmDTypeError as e:
                raise KvcalError(f"--vllm-dtype: {e}") from None

        if not self.contexts or any(int(c) < 2 for c in self.contexts):
            raise KvcalError("--context values must be integers >= 2 (e.g. 1024,4096,8192)")
        if not self.batches or any(int(b) < 1 for b in self.batches):
            raise KvcalError("--batch values must be integers >= 1 (e.g. 1,8)")
        if self.windows < 1:
            raise KvcalError("--windows must be at least 1")
        if self.decode_tokens < 1:
            raise KvcalError("--decode-tokens must be at least 1")
        bad = set(self.modes) - {"teacher_forced", "decode"}
        if bad or not self.modes:
            raise KvcalError(f"modes must be teacher_forced and/or decode, got {sorted(bad) or 'none'}")
        if self.accept is not None:
            parse_accept(self.accept)
        from kvcal.models import check_device

        check_device(self.device)


def evaluate(cfg: EvalConfig, log: Callable[[str], None] = print, progress: bool = True,
             model=None, tokenizer=None) -> dict:
    """Run ``kvcal evaluate``: the artifact and (optionally) the baselines, in both modes, at every
    context/batch regime. Returns the ``kvcal-eval/1`` document (module docstring).

    ``model``/``tokenizer``: already-loaded objects for ``cfg.model`` (tests); loaded offline
    otherwise. Raises :class:`~kvcal.errors.KvcalError` for a bad artifact (incl. a model
    mismatch), corpus or options."""
    import datetime as _dt
    import time

    from kvcal import __version__
    from kvcal.artifact import artifact_sha256, check_model_match, load_artifact
    from kvcal.errors import ArtifactError, KvcalError
    from kvcal.formats.memory import bytes_per_token, cache_bytes, model_shape
    from kvcal.formats.spec import preset
    from kvcal.models import check_max_positions, load_model, load_tokenizer, model_metadata
    from kvcal.plan import KVPlan

    art = load_artifact(cfg.artifact)
    art_max = (art.metadata.get("model") or {}).get("max_position_embeddings")
    if isinstance(art_max, int):  # before loading the model
        check_max_positions(max(int(c) for c in cfg.contexts), art_max, "--context", " (artifact metadata)")
    # every input error before the model loads: corpus format and fields (no tokenizer), the plan the
    # artifact describes, the model's shape from its config, then the token stream (tokenizer only)
    from kvcal.corpus import check_corpus, txt_token_bound

    corpus_opts = {"text_field": cfg.text_field, "messages_field": cfg.messages_field, "split": cfg.split}
    check_corpus(cfg.corpus, **corpus_opts)
    bound, t_max = txt_token_bound(cfg.corpus), max(int(c) for c in cfg.contexts)
    if bound is not None and bound < t_max:  # too short for one window whatever the tokenizer: say so before it loads
        raise KvcalError(f"corpus {cfg.corpus} has at most {bound:,} tokens (3 per byte of its size); context "
                         f"{t_max} needs at least {t_max} (use a longer corpus or a smaller --context)")
    try:
        plan = KVPlan.from_artifact(art.tensors, art.metadata)
    except (ValueError, KeyError) as e:
        raise ArtifactError(f"{art.path}: {e}") from None
    if model is None:
        from kvcal.models import load_model_config, resolve_model

        pre = model_metadata(load_model_config(cfg.model), resolve_model(cfg.model))
        check_model_match(art.metadata, pre)
        check_max_positions(max(int(c) for c in cfg.contexts), pre.get("max_position_embeddings") or 0, "--context")
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    contexts = sorted({int(c) for c in cfg.contexts})
    batches = sorted({int(b) for b in cfg.batches})
    ids, corpus_info = corpus_stream(cfg.corpus, tok, **corpus_opts)
    wins = {}
    for T in contexts:
        w = cut_windows(ids, T, cfg.windows)
        if len(w) == 0:
            raise KvcalError(f"corpus {cfg.corpus} has {ids.numel()} tokens; context {T} needs at least {T} "
                             "(use a longer corpus or a smaller --context)")
        wins[T] = w
    if model is None:
        model = load_model(cfg.model, device=cfg.device)
    mm = model_metadata(model.config, getattr(model, "kvcal_source", None), architecture=type(model).__name__)
    check_model_match(art.metadata, mm)
    L = plan.num_layers
    shp = model_shape(model.config)
    max_pos = mm.get("max_position_embeddings") or 0
    check_max_positions(contexts[-1], max_pos, "--context")
    notes = []
    device_kind = str(next(model.parameters()).device)
    if device_kind.startswith("cpu"):
        notes.append("CPU run: throughput is not measured; the figures are memory and quality only "
                     "(decode-step timings on CPU say nothing about GPU serving speed).")

    plans: dict[str, object] = {"artifact": plan}
    roles = {"16-bit": "reference", "artifact": "artifact"}
    if cfg.baselines:
        amax = artifact_amax(art.metadata)
        if amax is None:
            extra = cut_windows(ids, contexts[0], 2, skip=cfg.windows)
            if len(extra):
                amax = capture_amax(model, extra, L)
                notes.append(f"fp8-absmax: the artifact records no per-layer amax; absmax was captured on "
                             f"{len(extra)} windows of {contexts[0]} tokens after the evaluation windows "
                             "(disjoint from them).")
            else:
                notes.append("fp8-absmax omitted: no amax in the artifact and no corpus left after the "
                             "evaluation windows for a calibration capture.")
        else:
            notes.append("fp8-absmax: scales = per-layer calibration absmax (artifact metadata) / 448.")
        for name, p in baseline_plans(L, amax, cfg.kivi_window).items():
            plans[name] = p
            roles[name] = "baseline"
        notes.append(f"kivi4/kivi2 keep the {cfg.kivi_window} most recent tokens in 16 bits in decode mode "
                     "(KIVI's residual); teacher-forced rows quantize every key/value attention reads.")
    vllm_names = set()
    for d in dict.fromkeys(cfg.vllm_dtypes):
        from kvcal.vllm_plan import VllmKVPlan

        qt = [art.tensors.get(f"model.layers.{i}.self_attn.q_scale") for i in range(L)]  # calibrate --engine vllm
        kw = ({"q_scales": [t.reshape(-1) if t.numel() > 1 else float(t.reshape(-1)[0]) for t in qt]}
              if d in ("fp8", "fp8_e4m3") and all(t is not None for t in qt) else {})
        plans[f"vllm:{d}"], note = VllmKVPlan.from_kvcal_plan(d, plan, **kw)
        roles[f"vllm:{d}"] = "vllm"
        vllm_names.add(f"vllm:{d}")
        notes.append(note)
    if vllm_names and "decode" in cfg.modes:
        notes.append("vllm:* rows are teacher-forced only: every vLLM dtype quantizes each token's K/V on its own "
                     "(static or per-token scales), so a decode step reads exactly what Protocol A reads at that "
                     "position; kvcal's runtime cache does not hold vLLM layouts.")
    crit_str = {name: cfg.accept or default_accept(p) for name, p in plans.items()}
    crit = {name: parse_accept(s) for name, s in crit_str.items()}
    methods = {"16-bit": {"role": "reference", "label": f"unquantized K/V ({str(next(model.parameters()).dtype).replace('torch.', '')})",
                          "k": None, "v": None, "residual_window": 0, "sink_tokens": 0, "quantized_tensors": [],
                          "bits": 16, "criteria": ""}}
    for name, p in plans.items():
        desc = ({"k": None, "v": None, "residual_window": 0, "sink_tokens": 0,
                 "quantized_tensors": ["k", "v"] if p.quantized_bits() else [], **p.describe(),
                 "label": f"vLLM --kv-cache-dtype {p.kv_cache_dtype}", "bits": plan_bits(p)}
                if name in vllm_names else describe_plan(p))
        methods[name] = {"role": roles[name], **desc, "criteria": crit_str[name]}

    results, measured = [], []

    def add_rows(res: dict, mode: str, T: int, B: int, n_windows: int, seconds: float):
        for name, r in res.items():
            row = {"method": name, "mode": mode, "context": T, "batch": B,
                   **{k: r.get(k) for k in ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree")},
                   "greedy_agree": r.get("greedy_agree"), "greedy_prefix": r.get("greedy_prefix"),
                   "tokens": r["tokens"], "windows": n_windows, "seconds": round(seconds, 2)}
            if name == "16-bit":
                row.update(status="REFERENCE", criteria="", failed=[])
            else:
                st, failed = judge(row, crit[name])
                row.update(status=st, criteria=crit_str[name], failed=failed)
            results.append(row)

    eval_tokens = {}
    for T in contexts:
        w = wins[T]
        if "teacher_forced" in cfg.modes:
            bsz = min(batches[-1], len(w))
            t0 = time.perf_counter()
            log(f"teacher-forced: {len(w)} windows x {T} tokens, {len(plans)} methods")
            res = teacher_forced(model, w, plans, batch_size=bsz, progress=progress)
            add_rows(res, "teacher_forced", T, bsz, len(w), time.perf_counter() - t0)
            eval_tokens.setdefault(str(T), {})["teacher_forced"] = res["16-bit"]["tokens"]
        if "decode" in cfg.modes:
            for B in batches:
                t0 = time.perf_counter()
                log(f"decode: {len(w)} windows x {T} tokens, batch {B}, {min(cfg.decode_tokens, T - 1)} decoded "
                    f"positions each, {len(plans)} methods")
                meas: list = []
                res = decode_eval(model, w, {n: p for n, p in plans.items() if n not in vllm_names}, B,
                                  cfg.decode_tokens, cfg.greedy_tokens, progress, meas)
                add_rows(res, "decode", T, B, len(w), time.perf_counter() - t0)
                eval_tokens.setdefault(str(T), {})["decode"] = res["16-bit"]["tokens"]
                for m in meas:
                    measured.append({**m, "context": T})
                    if m["allocated_bytes"] != m["expected_bytes"]:
                        notes.append(f"{m['method']}: runtime cache held {m['allocated_bytes']} bytes, the accounting "
                                     f"says {m['expected_bytes']}: accounting and allocation disagree (a bug: please report)")

    per_layer = {}
    if cfg.per_layer_tokens:
        T0 = min(contexts[0], cfg.per_layer_tokens)
        log(f"per-layer errors on one window of {T0} tokens")
        per_layer = per_layer_errors(model, wins[contexts[0]][:1, :T0], plans)

    b16 = int(bytes_per_token(shp, preset("bf16")))
    memory = {"bytes_per_token": {}, "bytes_per_token_16bit": b16, "cache_bytes": {}, "measured": measured}
    for name, p in plans.items():
        if name in vllm_names:
            from kvcal.formats.memory import vllm_bytes_per_token, vllm_cache_bytes

            memory["bytes_per_token"][name] = vllm_bytes_per_token(shp, p.kv_cache_dtype, p.skipped)
            memory["cache_bytes"][name] = [
                {"context": T, "batch": B, "bytes": (nb := vllm_cache_bytes(shp, p.kv_cache_dtype, T, B,
                                                                            skip_layers=p.skipped)),
                 "vs_16bit": nb / (b16 * T * B)} for T in contexts for B in batches]
            continue
        cfgs = [p.kv_config(i) for i in range(L)]
        memory["bytes_per_token"][name] = bytes_per_token(shp, cfgs)
        memory["cache_bytes"][name] = []
        for T in contexts:
            for B in batches:
                nb = cache_bytes(shp, cfgs, T, B)
                memory["cache_bytes"][name].append({"context": T, "batch": B, "bytes": nb,
                                                    "vs_16bit": nb / (b16 * T * B)})

    art_rows = [r for r in results if r["method"] == "artifact"]
    passed = all(r["status"] == "PASS" for r in art_rows)
    calib = art.metadata.get("calibration")
    doc = {
        "schema": SCHEMA,
        "kvcal_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": passed,
        "exit_code": 0 if passed else 1,
        "artifact": {"path": str(art.path), "kv": art.metadata["kv"], "calibration": calib,
                     "corpus": art.metadata.get("corpus"), "sha256": artifact_sha256(art.path)},
        "model": mm,
        "corpus": {**corpus_info, "windows": {str(T): len(wins[T]) for T in contexts},
                   "window_source": ("whole file tokenized at once (no BOS), consecutive windows from the start"
                                     if corpus_info["kind"] == "txt" else
                                     "samples concatenated in file order, consecutive windows from the start"),
                   "eval_tokens": eval_tokens},
        "regimes": [{"context": T, "batch": B} for T in contexts for B in batches],
        "methods": methods,
        "results": results,
        "per_layer": per_layer,
        "memory": memory,
        "description": {
            "quantized_tensors": {n: m["quantized_tensors"] for n, m in methods.items()},
            "formats": {n: m["label"] for n, m in methods.items()},
            "weight_precision": mm.get("weight_precision"),
            "key_position": plan.key_position,
            "device": device_kind,
            "throughput": ("not measured (CPU run: memory and quality only)" if device_kind.startswith("cpu")
                           else "not measured by kvcal evaluate"),
            "context_regimes": contexts, "batch_regimes": batches,
            "decode_tokens": cfg.decode_tokens, "greedy_tokens": cfg.greedy_tokens,
            "modes": list(cfg.modes),
        },
        "notes": notes,
    }
    short = [T for T in contexts if "decode" in cfg.modes and cfg.decode_tokens > T - 1]
    if short:  # decode_eval decodes min(decode_tokens, T - 1) positions: the prompt keeps at least 1 token
        notes.append(f"--decode-tokens {cfg.decode_tokens} exceeds context {', '.join(map(str, short))} − 1: "
                     + ", ".join(f"{T - 1} tokens decoded at context {T}" for T in short))
        doc["description"]["decode_tokens_by_context"] = {str(T): min(cfg.decode_tokens, T - 1) for T in contexts}
    return doc


def render_table(doc: dict) -> str:
    """Plain-text table of the results (one line per method/mode/regime)."""
    lines = [f"{'method':<12} {'mode':<14} {'ctx':>5} {'B':>2} {'ppl':>8} {'dPPL':>8} {'KL mean':>9} "
             f"{'KL p99.9':>9} {'top1':>6} {'greedy':>6} {'B/tok':>8}  status"]
    bpt = doc["memory"]["bytes_per_token"]
    for r in doc["results"]:
        g = "" if r.get("greedy_agree") is None else f"{r['greedy_agree']:.2f}"
        b = bpt.get(r["method"], doc["memory"]["bytes_per_token_16bit"] if r["method"] == "16-bit" else float("nan"))
        lines.append(f"{r['method']:<12} {r['mode']:<14} {r['context']:>5} {r['batch']:>2} {r['ppl']:>8.3f} "
                     f"{r['delta_ppl']:>+8.3f} {r['kl_mean']:>9.2e} {r['kl_p999']:>9.3f} {r['top1_agree']:>6.1%} "
                     f"{g:>6} {b:>8g}  {r['status']}{' (' + '; '.join(r['failed']) + ')' if r['failed'] else ''}")
    return "\n".join(lines)


def to_json(doc: dict) -> str:
    """The document as JSON text; non-finite floats (a catastrophic method's ppl) become ``null``."""
    import json

    def clean(o):
        if isinstance(o, float):
            return o if math.isfinite(o) else None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    return json.dumps(clean(doc), indent=2, allow_nan=False)

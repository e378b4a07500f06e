"""The ``kvcal evaluate`` document: its JSON schema, JSON text and plain-text table.

JSON schema ``"kvcal-eval/1"`` (keys are stable; all losses in nats, bytes are exact integers)::

    {
      "schema": "kvcal-eval/1",
      "kvcal_version": str, "created": ISO-8601 str, "passed": bool, "exit_code": 0 | 1,
      "verdict": "PASS" | "FAIL" | "INCONCLUSIVE" (FAIL when a judged row fails; INCONCLUSIVE when none
                 fails but one's bound straddles its bar),
      "judged_method": the result rows that set "passed" ("artifact", or "vllm:<dtype>" for an artifact
                       calibrated for a vLLM dtype: the row of how vLLM serves it),
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
                   "status": "PASS" | "FAIL" | "INCONCLUSIVE" | "REFERENCE", "criteria": str, "failed": [str],
                   "per_window": {"nll", "ref_nll", "kl_mean", "top1_agree"[, "greedy_agree", "greedy_prefix"]:
                                  [float per window]},
                   "bounds": {metric: {"estimate", "bound", "lower", "upper", "method"}} (one-sided 95% t
                             bounds over the windows, kvcal.evaluate.bounds), "windows_needed": int | null}],
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
                      "decode_tokens": int, "greedy_tokens": int, "modes": [str],
                      "decode_tokens_by_context": {"<context>": int} (only when --decode-tokens
                      exceeds a context − 1)},
      "notes": [str]
    }

``teacher_forced`` rows do not depend on the batch (batching changes no value); they are computed
once per context and reported with the largest batch regime that was used to run them.
"""

from __future__ import annotations

import math

SCHEMA = "kvcal-eval/1"


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
                     f"{g:>6} {b:>8g}  {r['status']}{' (' + '; '.join(r['failed']) + ')' if r['failed'] else ''}"
                     + _bounds_text(r))
    return "\n".join(lines)


def _bounds_text(r: dict) -> str:
    """`` [kl_mean bound 1.3e-02, ...]``: the one-sided bounds a row's status was judged on
    (:func:`kvcal.evaluate.bounds.judge_bounded`), and the windows that would decide an INCONCLUSIVE row."""
    from kvcal.evaluate.bounds import bound_text

    bs = r.get("bounds") or {}
    parts = [f"{m} {bound_text(bs, m)}" for m in bs if str(bs[m].get("method", "")).startswith("one-sided")]
    if r.get("status") == "INCONCLUSIVE":
        n = r.get("windows_needed")
        parts.append(f"{n} windows would decide it" if n else "no window count would decide it at this spread")
    return f" [{'; '.join(parts)}]" if parts else ""


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

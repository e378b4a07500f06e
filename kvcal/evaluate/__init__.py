"""Model-level evaluation of a KV quantization plan (``kvcal evaluate``), one module per stage:

* :mod:`kvcal.evaluate.protocol_a` — Protocol A (teacher-forced, every K/V attention reads
  fake-quantized): :func:`teacher_forced`, and the probes ``kvcal calibrate`` uses,
  :func:`plans_kl` and :func:`side_sensitivity`;
* :mod:`kvcal.evaluate.decode` — decode mode through :class:`kvcal.runtime.QuantizedKVCache`:
  :func:`decode_eval`;
* :mod:`kvcal.evaluate.baselines` — bf16 / FP8 unity / FP8 absmax / KIVI plans, plan descriptions,
  per-layer attention errors;
* :mod:`kvcal.evaluate.accept` — acceptance criteria (:data:`DEFAULT_ACCEPT`, :func:`parse_accept`,
  :func:`judge`);
* :mod:`kvcal.evaluate.windows` — the token stream and its windows;
* :mod:`kvcal.evaluate.document` — the ``kvcal-eval/1`` JSON schema, :func:`to_json`,
  :func:`render_table`;
* :mod:`kvcal.evaluate.run` — :class:`EvalConfig` and the driver :func:`evaluate`.

Every name importable from ``kvcal.evaluate`` before the split (one module) is re-exported here.
"""

from kvcal.evaluate.accept import DEFAULT_ACCEPT, METRICS, default_accept, judge, parse_accept, plan_bits
from kvcal.evaluate.baselines import (
    artifact_amax,
    baseline_plans,
    capture_amax,
    describe_plan,
    fp8_plan,
    per_layer_errors,
)
from kvcal.evaluate.decode import decode_eval
from kvcal.evaluate.document import SCHEMA, render_table, to_json
from kvcal.evaluate.protocol_a import plan_hook, plans_kl, side_only, side_sensitivity, teacher_forced
from kvcal.evaluate.run import EvalConfig, evaluate
from kvcal.evaluate.windows import corpus_stream, cut_windows, text_windows

__all__ = [
    "DEFAULT_ACCEPT", "METRICS", "SCHEMA", "EvalConfig", "artifact_amax", "baseline_plans", "capture_amax",
    "corpus_stream", "cut_windows", "decode_eval", "default_accept", "describe_plan", "evaluate", "fp8_plan",
    "judge", "parse_accept", "per_layer_errors", "plan_bits", "plan_hook", "plans_kl", "render_table",
    "side_only", "side_sensitivity", "teacher_forced", "text_windows", "to_json",
]

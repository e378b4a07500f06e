"""Literal fixtures for the report / notebook tests: a small synthetic artifact (4 layers, 2 KV
heads, head_dim 8) and an evaluation JSON of schema ``kvcal-eval/1``. No model is loaded."""

from __future__ import annotations

import copy

L, H, D = 4, 2, 8


def make_meta(per_head: bool = False, channel_absmax: bool = False, num_layers: int = L, num_kv_heads: int = H,
              head_dim: int = D, max_pos: int = 4096) -> dict:
    """Artifact metadata shaped like ``kvcal.calibrate`` writes it."""
    L, H, D = num_layers, num_kv_heads, head_dim
    gran = "head" if per_head else "tensor"
    layers = []
    for i in range(L):
        lm = {"layer": i}
        for side, base in (("k", 10.0), ("v", 1.0)):
            amax = [base * (i + 1) + h for h in range(H)] if per_head else [base * (i + 1)]
            if i == 3 and side == "k" and L == 4:
                amax = [a * 20 for a in amax]  # an outlier layer
            ratio = [0.8] * len(amax)
            lm[side] = {
                "scale": [r * a / 448 for r, a in zip(ratio, amax, strict=True)], "amax": amax, "clip_ratio": ratio,
                "candidate": ["clip0.8"] * len(amax),
                "heldout": {"chosen": 1e-4 * (i + 1), "absmax": 2e-4 * (i + 1), "unity": 5e-2},
                "calib": {"chosen": 1e-4, "absmax": 2e-4, "unity": 5e-2},
            }
            if channel_absmax:
                rows = [[1.0 + 0.1 * d for d in range(D)] for _ in range(H)]
                if side == "k":
                    rows[1][5] = 50.0  # an outlier channel in head 1 of every layer
                lm[side]["channel_absmax"] = rows
        layers.append(lm)
    spec = {"format": "fp8_e4m3", "granularity": gran, "group_size": None, "symmetric": True,
            "scale_dtype": "float32", "dynamic": False, "bits": 8}
    return {
        "kvcal_version": "0.1.0", "created": "2025-01-01T00:00:00+00:00",
        "model": {"id": "tiny-llama", "config_sha256": "ab" * 32, "architecture": "LlamaForCausalLM",
                  "model_type": "llama", "num_layers": L, "num_attention_heads": 4, "num_kv_heads": H,
                  "head_dim": D, "max_position_embeddings": max_pos,
                  "weight_precision": "GGUF Q4_1 weights, dequantized to float32 for computation"},
        "kv": {"quantized_tensors": ["k", "v"], "key_position": "post_rope", "k": dict(spec), "v": dict(spec),
               "residual_window": 0, "sink_tokens": 0, "key_centering": False},
        "calibration": {"method": "attention-aware static scale search", "objective_k": "attention KL",
                        "objective_v": "relative output error", "candidates": "absmax, unity, clip",
                        "selection": "held-out guard", "seed": 0, "max_seq_len": 512, "heldout_fraction": 0.25,
                        "calib_samples": 48, "heldout_samples": 16,
                        "reservoir_sequences": {"calib": 12, "heldout": 6}, "search_tokens": 512,
                        "max_queries": 128, "capture_seconds": 1.0, "search_seconds": 2.0, "device": "cpu",
                        "context_regime": "prefill of samples up to 512 tokens, batch 8"},
        "corpus": {"path": "calibration_sets/chat.jsonl", "sha256": "cd" * 32, "format": "chat-jsonl",
                   "samples": 64, "tokens": 20000,
                   "length_percentiles": {"p50": 280, "p90": 480, "p99": 512, "max": 512}, "truncated": 3},
        "layers": layers,
    }


def make_tensors(meta: dict) -> dict:
    import torch

    t = {}
    for lm in meta["layers"]:
        for side in ("k", "v"):
            s = torch.tensor(lm[side]["scale"], dtype=torch.float32)
            t[f"model.layers.{lm['layer']}.self_attn.{side}_scale"] = s if s.numel() == 1 else s.reshape(-1, 1, 1)
    return t


def make_artifact(path, **kw):
    from kvcal.artifact import write_artifact

    meta = make_meta(**kw)
    return write_artifact(path, make_tensors(meta), meta)


_RESULT = {"ppl": 16.0, "delta_ppl": 0.0, "kl_mean": 0.0, "kl_p999": 0.0, "top1_agree": 1.0,
           "greedy_agree": 1.0, "greedy_prefix": 1.0, "tokens": 4000, "windows": 2, "seconds": 1.0}
_CRIT = "kl_mean<=2e-3,delta_ppl<=0.05"

# shaped like the "kvcal-eval/1" JSON documented in kvcal/evaluate/document.py
EVAL = {
    "schema": "kvcal-eval/1", "kvcal_version": "0.1.0", "created": "2025-01-02T00:00:00+00:00",
    "passed": True, "exit_code": 0,
    "artifact": {"path": "artifacts/tiny-fp8", "kv": {}, "calibration": None, "corpus": None},
    "model": {"id": "tiny-llama", "num_layers": L, "num_kv_heads": H, "head_dim": D,
              "weight_precision": "GGUF Q4_1 weights, dequantized to float32 for computation"},
    "corpus": {"path": "shared/data/wiki.txt", "sha256": "ef" * 32, "kind": "txt", "tokens": 65536,
               "windows": {"1024": 8, "4096": 2}, "window_source": "whole file tokenized at once (no BOS)",
               "eval_tokens": {"1024": {"teacher_forced": 8184, "decode": 512}}},
    "regimes": [{"context": 1024, "batch": 1}, {"context": 4096, "batch": 1}],
    "methods": {
        "16-bit": {"role": "reference", "label": "unquantized K/V (float32)", "bits": 16, "criteria": ""},
        "fp8-absmax": {"role": "baseline", "label": "K fp8_e4m3 tensor, V fp8_e4m3 tensor", "bits": 8,
                       "criteria": _CRIT},
        "artifact": {"role": "artifact", "label": "K fp8_e4m3 head, V fp8_e4m3 head", "bits": 8, "criteria": _CRIT},
    },
    "results": [],
    "per_layer": {"artifact": {"k_attention_kl": [1e-4, 2e-4, 3e-4, 4e-4], "v_output_error": [1e-3] * 4,
                               "tokens": 512, "queries": 512},
                  "fp8-absmax": {"k_attention_kl": [2e-4, 3e-4, 4e-4, 9e-4], "v_output_error": [2e-3] * 4}},
    "memory": {"bytes_per_token": {"fp8-absmax": 128.0, "artifact": 128.0}, "bytes_per_token_16bit": 256,
               "cache_bytes": {"artifact": [{"context": 1024, "batch": 1, "bytes": 131136, "vs_16bit": 0.5}]},
               "measured": [{"method": "artifact", "context": 1024, "batch": 1, "cache_tokens": 1024,
                             "allocated_bytes": 131136, "expected_bytes": 131136}]},
    "description": {"weight_precision": "GGUF Q4_1 weights, dequantized to float32 for computation",
                    "device": "cpu", "throughput": "not measured (CPU run: memory and quality only)",
                    "decode_tokens": 64, "greedy_tokens": 16, "context_regimes": [1024, 4096],
                    "batch_regimes": [1]},
    "notes": ["CPU run: memory and quality only, no throughput."],
}
for _ctx in (1024, 4096):
    for _m, _mode, _dppl, _kl, _st in (
        ("16-bit", "teacher_forced", 0.0, 0.0, "REFERENCE"),
        ("fp8-absmax", "teacher_forced", 0.06, 3e-3, "FAIL"),
        ("artifact", "teacher_forced", 0.02, 1e-3, "PASS"),
        ("artifact", "decode", 0.03, 1.5e-3, "PASS"),
    ):
        EVAL["results"].append({**_RESULT, "method": _m, "mode": _mode, "context": _ctx, "batch": 1,
                                "ppl": 16.0 + _dppl, "delta_ppl": _dppl, "kl_mean": _kl, "kl_p999": 10 * _kl,
                                "status": _st, "criteria": "" if _st == "REFERENCE" else _CRIT,
                                "failed": ["kl_mean<=2e-3", "delta_ppl<=0.05"] if _st == "FAIL" else []})


def make_eval(**changes) -> dict:
    ev = copy.deepcopy(EVAL)
    ev.update(changes)
    return ev


def make_int_meta() -> dict:
    """Integer artifact metadata shaped like ``kvcal.calibrate``'s integer branch writes it
    (preset int4: static per-channel asymmetric keys, dynamic per-token-group values)."""
    meta = make_meta()
    k = {"format": "int4", "granularity": "channel", "group_size": None, "symmetric": False,
         "scale_dtype": "float32", "dynamic": False, "bits": 4}
    v = {"format": "int4", "granularity": "token_group", "group_size": 32, "symmetric": False,
         "scale_dtype": "float16", "dynamic": True, "bits": 4}
    meta["kv"].update(k=k, v=v, sink_tokens=4, residual_window=0)
    meta["calibration"] = {"method": "attention-aware integer search", "preset": "int4", "bits_budget": None,
                           "average_bits": 4.3125, "average_bits_context": 4096, "objective_k": "kl",
                           "objective_v": "out", "seed": 0, "max_seq_len": 512,
                           "context_regime": "prefill of samples up to 512 tokens, batch 8"}
    meta["layers"] = [{"layer": i,
                       "k": {"spec": k, "param": [1.5] * H, "label": ["z1.5"] * H, "calib": 1e-3,
                             "heldout": 2e-3 * (i + 1), "heldout_minmax": 5e-3 * (i + 1), "heldout_out": 0.01},
                       "v": {"spec": v, "param": [0.9] * H, "label": ["clip0.9"] * H, "calib": 1e-3,
                             "heldout": 3e-3, "heldout_minmax": 4e-3, "heldout_out": 3e-3}}
                      for i in range(L)]
    return meta


def make_int_tensors() -> dict:
    import torch

    t = {}
    for i in range(L):
        t[f"model.layers.{i}.self_attn.k_scale"] = torch.full((H, 1, D), 0.1)
        t[f"model.layers.{i}.self_attn.k_zero_point"] = torch.full((H, 1, D), 7.0)
        t[f"model.layers.{i}.self_attn.v_clip_ratio"] = torch.tensor([0.9, 0.85])
    return t

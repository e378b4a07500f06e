"""Serve token windows in a real vLLM and return per-token figures (runs in the engine's own Python).

This file is executed by the engine's interpreter (``kvcal verify --engine-python PATH``), never
imported by kvcal: it imports only the standard library, torch and vllm. Input: a JSON request
(``argv[1]``); output: a JSON result (``argv[2]``). A refusal by the engine (a dtype this CPU or
backend cannot serve, a model it cannot load) is written as ``{"error": "<one line>"}`` with exit
status 3.

Request::

    {"windows": [[token ids], ...],            # N windows of T tokens each
     "max_model_len": T, "dtype": "float32",
     "runs": [{"name": "16-bit", "model_dir": DIR, "kv_cache_dtype": "auto"},
              {"name": "fp8", "model_dir": DIR, "kv_cache_dtype": "fp8",
               "skip_layers": ["0", "29"]}, ...],          # optional: --kv-cache-dtype-skip-layers
     "reference": "16-bit", "top_k": 5}

Each run starts ``vllm.LLM`` (in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and asks for
``prompt_logprobs`` of every window (``SamplingParams(max_tokens=1, prompt_logprobs=top_k)``). The
full-vocabulary logits vLLM computes for those prompt positions are observed by a forward hook on
the model's ``logits_processor`` (the module whose output vLLM's sampler turns into the served
log-probabilities; the hook reads, it changes nothing); the served ``prompt_logprobs`` of each
target token are compared with ``log_softmax`` of the observed rows (``align_max_abs``) so the
rows are proven to be the served ones. Per run and window: NLL of every target token (nats), and
against the reference run the per-position ``KL(P_ref ‖ P_run)`` (nats, float64 over the full
vocabulary) and top-1 agreement. Also per run: the static ``k_scale``/``v_scale`` every attention
layer holds after loading (``_k_scale_float``/``_v_scale_float``), the attention backend, and timings.
"""

from __future__ import annotations

import json
import os
import sys
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
    windows = req["windows"]
    top_k = int(req.get("top_k", 5))
    result = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "runs": {}}
    ref_logp: list = []
    captured: list = []

    def hook(_module, _inputs, output):
        captured.append(output.detach().to(torch.float32).cpu().clone())

    for run in req["runs"]:
        t0 = time.perf_counter()
        try:
            extra = {"kv_cache_dtype_skip_layers": list(run["skip_layers"])} if run.get("skip_layers") else {}
            llm = LLM(model=run["model_dir"], dtype=req.get("dtype", "float32"), kv_cache_dtype=run["kv_cache_dtype"],
                      enforce_eager=True, max_model_len=int(req["max_model_len"]) + 1, max_logprobs=top_k,
                      skip_tokenizer_init=True, seed=0, max_num_seqs=1, **extra)
        except Exception as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            root = e
            while root.__cause__ is not None:
                root = root.__cause__
            if root is not e and str(root).strip():
                msg = str(root).strip().splitlines()[-1]
            _fail(out_path, f"vLLM {vllm.__version__} cannot serve {run['model_dir']} with --kv-cache-dtype "
                            f"{run['kv_cache_dtype']}: {type(root).__name__}: {msg}")
        start_s = time.perf_counter() - t0
        handles = llm.apply_model(lambda m: m.logits_processor.register_forward_hook(hook))
        scales = llm.apply_model(_layer_scales)[0]
        backend = llm.apply_model(lambda m: sorted({type(getattr(x, "impl", None)).__name__ for _, x in m.named_modules()
                                                    if hasattr(x, "_k_scale_float")}))[0]
        sp = SamplingParams(max_tokens=1, prompt_logprobs=top_k, temperature=0.0)
        nll, kl, top1, align = [], [], [], 0.0
        t1 = time.perf_counter()
        for wi, w in enumerate(windows):
            captured.clear()
            out = llm.generate([{"prompt_token_ids": list(map(int, w))}], sp, use_tqdm=False)[0]
            rows = torch.cat(captured, 0) if captured else torch.zeros(0)
            n = len(w) - 1
            if rows.dim() != 2 or rows.shape[0] < n:
                _fail(out_path, f"observed {tuple(rows.shape)} logit rows for a {len(w)}-token prompt; expected at "
                                f"least {n} (this vLLM computes prompt log-probabilities differently)")
            tgt = torch.tensor(w[1:], dtype=torch.long)
            served = torch.tensor([out.prompt_logprobs[i + 1][int(w[i + 1])].logprob for i in range(n)],
                                  dtype=torch.float64)
            # the sampling step's row(s) and the prompt rows arrive in separate calls, in an order this
            # vLLM chooses: take the n consecutive rows (starting at a call boundary) whose log-softmax
            # reproduces the served prompt log-probabilities
            starts, c = [], 0
            for t in captured:
                starts.append(c)
                c += t.shape[0]
            best = None
            for o in starts:
                if o + n > rows.shape[0]:
                    continue
                lp_o = torch.log_softmax(rows[o:o + n].double(), -1)
                err = float((served - lp_o.gather(-1, tgt[:, None])[:, 0]).abs().max())
                if best is None or err < best[0]:
                    best = (err, lp_o)
            if best is None:
                _fail(out_path, f"no {n} consecutive logit rows observed for a {len(w)}-token prompt")
            align = max(align, best[0])
            logp = best[1]  # positions 0..T-2 predict tokens 1..T-1
            tok_lp = logp.gather(-1, tgt[:, None])[:, 0]
            nll.append((-tok_lp).tolist())
            if run["name"] == req["reference"]:
                ref_logp.append(logp.to(torch.float32))
                kl.append([0.0] * n)
                top1.append([1] * n)
            else:
                lr = ref_logp[wi].double()
                kl.append((lr.exp() * (lr - logp)).sum(-1).tolist())
                top1.append((lr.argmax(-1) == logp.argmax(-1)).int().tolist())
        for h in handles:
            h.remove()
        result["runs"][run["name"]] = {
            "kv_cache_dtype": run["kv_cache_dtype"], "model_dir": run["model_dir"], "nll": nll, "kl": kl,
            "top1": top1, "align_max_abs": align, "layer_scales": scales, "attention_impl": backend,
            "engine_start_s": round(start_s, 2), "serve_s": round(time.perf_counter() - t1, 2)}
        del llm
        import gc

        gc.collect()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python vllm_runner.py REQUEST.json RESULT.json")
    main(sys.argv[1], sys.argv[2])

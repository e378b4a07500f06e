"""Serve token windows in llama-cpp-python with each ``-ctk``/``-ctv`` pair; return per-window figures (runs in the
engine's own Python).

This file is executed by the engine's interpreter (``kvcal verify --engine llamacpp --engine-python PATH``), never
imported by kvcal: it imports only the standard library, numpy and ``llama_cpp``. Input: a JSON request (``argv[1]``);
output: a JSON result (``argv[2]``). A refusal (``llama_cpp`` not importable, a model it cannot load, a cache type it
refuses) is written as ``{"error": "<one line>"}`` with exit status 3.

Request::

    {"gguf": PATH,                           # the .gguf llama.cpp loads
     "windows": [[token ids], ...],          # N windows of T tokens each (the ids are evaluated as given: no BOS
                                             # added, nothing tokenized here)
     "reference": ["f16", "f16"],            # -ctk/-ctv of the reference run
     "pairs": [["q8_0", "q8_0"], ...],       # -ctk/-ctv of each compared run
     "threads": 2,                           # n_threads and n_threads_batch
     "chunk_rows": 256, "scratch_dir": DIR}  # optional: positions per float64 chunk; where the reference goes

Every run builds ``Llama(model_path, n_ctx = n_batch = n_ubatch = T, logits_all=True, flash_attn=True, type_k,
type_v)`` (one ubatch holds a whole window: teacher-forced prefill, the path kvcal's plan models) and evaluates each
window from an empty cache (``reset``; ``eval`` clears the cache from position 0). Position ``t``'s logits predict
token ``t+1``: per window, the mean over its ``T-1`` positions of the NLL of the next token (nats) and, against the
reference run, of ``KL(P_ref || P_pair)`` (nats, float64 over the full vocabulary), and top-1 agreement. The
reference's log-probabilities (float32, as computed from float32 logits) go to a scratch file (``scratch_dir``,
default: the result's folder) read back chunk by chunk, and are removed at exit. llama.cpp's own log (its
``llama_log_set`` callback, replaced here) is kept for the lines ``llama_kv_cache: size = ...`` that state the caches
it allocated (``kv_log``: newline-joined, two for an iSWA cache) and for the last error it printed.

Result::

    {"llama_cpp_version": "0.3.36", "n_ctx": T, "windows": N, "tokens_per_window": T - 1, "vocab": V,
     "reference": {"type_k", "type_v", "nll": [N], "kv_log": LINES or null, "load_s", "eval_s"},
     "pairs": [{"type_k", "type_v", "nll": [N], "kl": [N], "top1": [N], "kv_log", "load_s", "eval_s"}, ...],
     "peak_rss_mb": ...}
"""

from __future__ import annotations

import json
import os
import sys
import time

#: ``enum ggml_type`` (``ggml/include/ggml.h``) for the cache types ``-ctk``/``-ctv`` take; used when ``llama_cpp``
#: does not export the ``GGML_TYPE_<NAME>`` constant
GGML_TYPE_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}


def _fail(out: str, msg: str) -> None:
    with open(out, "w") as f:
        json.dump({"error": " ".join(str(msg).split())}, f)
    sys.exit(3)


def type_id(lib, name: str) -> int:
    """The ``ggml_type`` id of cache type ``name`` (``lib``'s constant when it has one). ``KeyError`` when unknown."""
    if name not in GGML_TYPE_IDS:
        raise KeyError(name)
    return int(getattr(lib, "GGML_TYPE_" + name.upper(), GGML_TYPE_IDS[name]))


def log_softmax64(scores):
    """Row-wise log-softmax in float64 of float32 logits ``[R, V]``."""
    import numpy as np

    s = np.asarray(scores, dtype=np.float64)
    s = s - s.max(-1, keepdims=True)
    return s - np.log(np.exp(s).sum(-1, keepdims=True))


def window_figures(ref_lp, scores, targets, chunk_rows: int = 256):
    """``(mean NLL, mean KL(P_ref || P), top-1 agreement)`` of one window: ``ref_lp`` float log-probabilities of the
    reference ``[T-1, V]`` (``None``: the run is the reference, KL 0), ``scores`` the run's float32 logits of the
    first ``T-1`` positions ``[T-1, V]``, ``targets`` the next tokens ``[T-1]``. Reduced in float64, ``chunk_rows``
    positions at a time (every operation is row-wise)."""
    import numpy as np

    n = len(targets)
    nll = kl = agree = 0.0
    for a in range(0, n, chunk_rows):
        b = min(a + chunk_rows, n)
        lp = log_softmax64(scores[a:b])
        nll += float(-lp[np.arange(b - a), targets[a:b]].sum())
        if ref_lp is not None:
            lr = np.asarray(ref_lp[a:b], dtype=np.float64)
            kl += float((np.exp(lr) * (lr - lp)).sum())
            agree += float((lr.argmax(-1) == lp.argmax(-1)).sum())
        else:
            agree += b - a
    return nll / n, kl / n, agree / n


class _Log:
    """llama.cpp's log, caught through ``llama_log_set`` (text arrives in pieces; lines are joined here)."""

    def __init__(self, lib):
        import ctypes

        self.text = []

        def cb(level, text, user_data):
            try:
                self.text.append(text.decode("utf-8", "replace"))
            except Exception:  # a callback must not raise into C
                pass

        self._cb = lib.llama_log_callback(cb)  # kept referenced: C holds the pointer
        lib.llama_log_set(self._cb, ctypes.c_void_p(0))

    def mark(self) -> int:
        return len(self.text)

    def lines(self, since: int = 0) -> list[str]:
        return [ln.strip() for ln in "".join(self.text[since:]).splitlines() if ln.strip()]

    def kv_line(self, since: int) -> str | None:
        got = [ln for ln in self.lines(since) if ln.startswith("llama_kv_cache: size")]
        return "\n".join(got) if got else None  # two for an iSWA cache (full-attention, then sliding-window)

    def last_error(self, since: int) -> str | None:
        got = [ln for ln in self.lines(since) if any(w in ln.lower() for w in ("error", "failed", "requires",
                                                                               "not supported"))]
        return got[-1] if got else None


def open_request(argv: list[str], fail=None):
    """``(request, output path, numpy, llama_cpp, Llama)`` of a runner's command line (``argv[1]`` the JSON request,
    ``argv[2]`` the output); ``fail(out, message)`` (default :func:`_fail`) reports numpy or llama_cpp missing."""
    fail = fail or _fail
    req_path, out = argv[1], argv[2]
    with open(req_path) as f:
        req = json.load(f)
    try:
        import numpy as np
    except ImportError as e:
        fail(out, f"numpy is not importable in this Python ({e})")
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        fail(out, f"llama_cpp is not importable in this Python ({e}); build llama-cpp-python's venv with "
                  "`make llamacpp-venv`")
    return req, out, np, llama_cpp, Llama


def main(argv: list[str]) -> int:
    req, out, np, llama_cpp, Llama = open_request(argv)
    log = _Log(llama_cpp.llama_cpp if hasattr(llama_cpp, "llama_cpp") else llama_cpp)
    windows = np.asarray(req["windows"], dtype=np.int64)
    N, T = windows.shape
    threads = int(req.get("threads") or os.cpu_count() or 1)
    chunk = int(req.get("chunk_rows", 256))
    scratch_dir = req.get("scratch_dir") or os.path.dirname(os.path.abspath(out))
    lib = llama_cpp.llama_cpp if hasattr(llama_cpp, "llama_cpp") else llama_cpp

    def build(tk: str, tv: str):
        try:
            ik, iv = type_id(lib, tk), type_id(lib, tv)
        except KeyError as e:
            _fail(out, f"unknown cache type {e.args[0]!r}")
        mark = log.mark()
        t0 = time.perf_counter()
        try:
            llm = Llama(model_path=req["gguf"], n_ctx=T, n_batch=T, n_ubatch=T, logits_all=True, flash_attn=True,
                        type_k=ik, type_v=iv, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
        except Exception as e:  # llama-cpp-python raises ValueError with no reason; llama.cpp logged it
            why = log.last_error(mark)
            _fail(out, f"llama.cpp refused -ctk {tk} -ctv {tv} on {req['gguf']}: {why or e}")
        return llm, log.kv_line(mark), time.perf_counter() - t0

    def serve(llm, w):
        llm.reset()
        llm.eval([int(x) for x in w])
        return np.asarray(llm.scores[: T - 1], dtype=np.float32)

    vocab = None
    ref_path = os.path.join(scratch_dir, f"kvcal-llamacpp-ref-{os.getpid()}.npy")
    result = {"llama_cpp_version": getattr(llama_cpp, "__version__", None), "n_ctx": int(T), "windows": int(N),
              "tokens_per_window": int(T - 1), "threads": threads}
    try:
        rk, rv = req.get("reference", ["f16", "f16"])
        llm, kv_log, load_s = build(rk, rv)
        ref = None
        t0 = time.perf_counter()
        nll = []
        for i, w in enumerate(windows):
            s = serve(llm, w)
            if ref is None:
                vocab = int(s.shape[1])
                ref = np.lib.format.open_memmap(ref_path, mode="w+", dtype=np.float32, shape=(N, T - 1, vocab))
            for a in range(0, T - 1, chunk):
                ref[i, a:a + chunk] = log_softmax64(s[a:a + chunk]).astype(np.float32)
            nll.append(window_figures(None, s, w[1:], chunk)[0])
        result["reference"] = {"type_k": rk, "type_v": rv, "nll": nll, "kv_log": kv_log, "load_s": load_s,
                               "eval_s": time.perf_counter() - t0}
        del llm
        result["vocab"] = vocab
        result["pairs"] = []
        for tk, tv in req["pairs"]:
            llm, kv_log, load_s = build(tk, tv)
            t0 = time.perf_counter()
            figs = [window_figures(ref[i], serve(llm, w), w[1:], chunk) for i, w in enumerate(windows)]
            del llm
            result["pairs"].append({"type_k": tk, "type_v": tv, "nll": [f[0] for f in figs],
                                    "kl": [f[1] for f in figs], "top1": [f[2] for f in figs], "kv_log": kv_log,
                                    "load_s": load_s, "eval_s": time.perf_counter() - t0})
        del ref
    finally:
        if os.path.exists(ref_path):
            os.remove(ref_path)
    try:
        import resource

        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except Exception:
        pass
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))

"""Capture one attention layer of llama.cpp as it runs (runs in the engine's own Python): the post-RoPE query, key
and value it computes, the bytes its K/V cache holds, and the flash-attention output.

This file is executed by the engine's interpreter, never imported by kvcal: it imports only the standard library,
numpy and ``llama_cpp``. Input: a JSON request (``argv[1]``); output: an ``.npz`` (``argv[2]``). A refusal is written
as ``{"error": "<one line>"}`` to ``argv[2] + ".json"`` with exit status 3.

Request::

    {"gguf": PATH, "tokens": [ids], "type_k": "q4_0", "type_v": "q4_0", "layer": 0, "threads": 2}

The window is evaluated as :mod:`.runner` evaluates one (``Llama(n_ctx = n_batch = n_ubatch = T, flash_attn=True,
type_k, type_v)``, one ubatch, empty cache). ggml's graph callback (``llama_context_params.cb_eval``,
``ggml_backend_sched_eval_callback``; set through ``llama_context_default_params``, which ``Llama.__init__`` calls)
asks for the nodes ``Qcur-L``, ``Kcur-L``, ``Vcur-L`` (named by the model builder after RoPE, ``src/models/*.cpp``)
(the last node of each name: ``build_qkv`` names the projections alike before RoPE) and ``kqv_out-L``
(``llm_graph_context::build_attn``, ``src/llama-graph.cpp``: the flash-attention result, before
the V back-rotation and the output projection); when ``kqv_out-L`` is computed, its source (the
``FLASH_ATTN_EXT`` node) holds in ``src[0..2]`` the query it read and the K/V cache views, read here byte for byte.
Tensors are read through ``struct ggml_tensor`` (``ggml/include/ggml.h``: type, buffer, ne[4], nb[4], op,
op_params[16], flags, src[10], view_src, view_offs, data, name[64], extra, padding[8]) on the CPU backend, where
``data`` is host memory.

Result (``.npz``): ``q``, ``k``, ``v`` float32 ``[T, H, D]`` (``Qcur``/``Kcur``/``Vcur``, in the GGUF's head order);
``q_fa`` float32 ``[H, T, D]`` (the query flash attention read: rotated when K is); ``k_cache``, ``v_cache`` uint8
``[T, H_kv, row_bytes]`` (each cell's row of each KV head as stored, ``row_bytes = D / blck · type_size``);
``kqv_out`` float32 ``[T, H · D]``; ``k_type``/``v_type`` (ggml type ids of the cache views).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of ``ggml/include/ggml.h`` (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64)."""


GgmlTensor._fields_ = [
    ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
    ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * 10), ("view_src", ctypes.POINTER(GgmlTensor)), ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]

#: bytes per block and elements per block of the cache types (``type_traits``, ``ggml/src/ggml.c``)
TYPE_SIZE = {0: (4, 1), 1: (2, 1), 30: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
             20: (18, 32)}


def _fail(out: str, msg: str) -> None:
    with open(out + ".json", "w") as f:
        json.dump({"error": " ".join(str(msg).split())}, f)
    sys.exit(3)


def read_f32(t: GgmlTensor):
    """A float32 tensor ``[ne3, ne2, ne1, ne0]`` (numpy order) copied through its byte strides."""
    import numpy as np

    ne, nb = list(t.ne), list(t.nb)
    extent = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + 4
    buf = (ctypes.c_char * extent).from_address(t.data)
    return np.ndarray(tuple(ne[::-1]), dtype=np.float32, buffer=buf, strides=tuple(nb[::-1])).copy()


def read_rows(t: GgmlTensor, n_cells: int):
    """The stored bytes of the K/V cache view flash attention reads, ``[D, n_kv, H_kv, n_stream]`` (``get_k``'s
    ``[D, H_kv, n_kv, n_stream]`` permuted by ``build_attn_mha``): uint8 ``[n_cells, H_kv, row_bytes]`` of stream
    0, each row read at ``data + cell · nb[1] + head · nb[2]``."""
    import numpy as np

    size, blck = TYPE_SIZE[t.type]
    row = t.ne[0] // blck * size
    out = np.empty((n_cells, t.ne[2], row), dtype=np.uint8)
    for c in range(n_cells):
        for h in range(t.ne[2]):
            out[c, h] = np.frombuffer(ctypes.string_at(t.data + c * t.nb[1] + h * t.nb[2], row), dtype=np.uint8)
    return out


def main(argv: list[str]) -> int:
    from runner import (  # this folder's runner.py (sys.path[0] of a script)
        GGML_TYPE_IDS,
        open_request,
        type_id,
    )

    req, out, np, llama_cpp, Llama = open_request(argv, _fail)
    lib = llama_cpp.llama_cpp
    tokens = [int(x) for x in req["tokens"]]
    T, L = len(tokens), int(req.get("layer", 0))
    want = {f"Qcur-{L}": "q", f"Kcur-{L}": "k", f"Vcur-{L}": "v", f"kqv_out-{L}": "kqv_out"}
    got: dict = {}

    def cb(ptr, ask, user_data):
        try:
            t = ctypes.cast(ptr, ctypes.POINTER(GgmlTensor)).contents
            name = t.name.decode("utf-8", "replace")
            if ask:
                return name in want
            if name in want:  # the last node of the name: Qcur/Kcur/Vcur after RoPE (build_qkv names them first)
                got[want[name]] = read_f32(t)
                if want[name] == "kqv_out":
                    fa = t.src[0].contents  # the FLASH_ATTN_EXT node (kqv_out is its 2-D reshape)
                    got["q_fa"] = read_f32(fa.src[0].contents)
                    kv, vv = fa.src[1].contents, fa.src[2].contents
                    got["k_cache"], got["v_cache"] = read_rows(kv, T), read_rows(vv, T)
                    got["k_type"], got["v_type"] = np.int64(kv.type), np.int64(vv.type)
        except Exception as e:  # a callback must not raise into C
            got.setdefault("error", repr(e))
        return True

    c_cb = lib.ggml_backend_sched_eval_callback(cb)
    default = lib.llama_context_default_params

    def params():
        p = default()
        p.cb_eval = c_cb
        p.cb_eval_user_data = None
        return p

    lib.llama_context_default_params = params  # Llama.__init__ takes its context parameters from here
    quiet = lib.llama_log_callback(lambda *a: None)  # kept referenced: C holds the pointer
    lib.llama_log_set(quiet, ctypes.c_void_p(0))
    try:
        ik, iv = type_id(lib, req["type_k"]), type_id(lib, req["type_v"])
    except KeyError as e:
        _fail(out, f"unknown cache type {e.args[0]!r}; choose from {', '.join(GGML_TYPE_IDS)}")
    threads = int(req.get("threads") or os.cpu_count() or 1)
    try:
        llm = Llama(model_path=req["gguf"], n_ctx=T, n_batch=T, n_ubatch=T, logits_all=True, flash_attn=True,
                    type_k=ik, type_v=iv, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    except Exception as e:
        _fail(out, f"llama.cpp refused -ctk {req['type_k']} -ctv {req['type_v']} on {req['gguf']}: {e}")
    llm.reset()
    llm.eval(tokens)
    llm.close()  # freed while the callbacks above are alive
    if "error" in got:
        _fail(out, f"reading layer {L}'s tensors failed: {got['error']}")
    lost = [k for k in ("q", "k", "v", "kqv_out") if k not in got]
    if lost:
        _fail(out, f"llama.cpp's graph had no node for {', '.join(lost)} of layer {L} (names {sorted(want)})")
    # ggml order [T, H, D] for q/k/v ([ne3=1, ne2=T, ne1=H, ne0=D] -> drop the leading 1)
    arrays = {k: (v[0] if isinstance(v, np.ndarray) and v.ndim == 4 and v.shape[0] == 1 else v) for k, v in got.items()}
    arrays["llama_cpp_version"] = np.array(getattr(llama_cpp, "__version__", ""))
    np.savez(out, **arrays)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))

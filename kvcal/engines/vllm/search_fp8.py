"""Static scales for vLLM 0.33's ``--kv-cache-dtype fp8`` with FP8 queries: ``q_scale``, ``k_scale``, ``v_scale``
(torch only).

What vLLM does (0.33.0 wheel, paths inside ``vllm/``): with an ``fp8``/``fp8_e4m3`` cache and a backend that
accepts quantized queries (FlashAttention 3, FlashInfer, Triton), ``Attention.forward``
(``model_executor/layers/attention/attention.py``) quantizes the post-RoPE queries to e4m3 with the
static ``_q_scale`` (``QuantFP8(static=True)``: per tensor, or one scale per KV-head group when the
checkpoint's ``q_scale`` has ``num_kv_heads`` entries — compressed-tensors ``strategy: "attn_head"``,
whose loader reduces a ``[num_heads, 1, 1]`` tensor to the max of each group). The keys are stored as
e4m3 ``sat(k / k_scale)``. The attention kernel then multiplies the FP8 codes and folds both scales into
the softmax scale: FlashInfer ``bmm1_scale = sm_scale · q_scale · k_scale``
(``v1/attention/backends/flashinfer.py``), FlashAttention 3 ``q_descale · k_descale`` per
(sequence, KV head) (``v1/attention/backends/flash_attn.py``). A checkpoint without ``q_scale`` runs
at 1.0 (``kv_cache.py`` ``process_weights_after_loading``; compressed-tensors initialises it to ones).

So the scores attention sees are ``s_ij = (q̂c_i · k̂c_j) · (scaling · q_scale · k_scale)`` with
``q̂c = e4m3(sat(q · (1/q_scale)))`` and ``k̂c = e4m3(sat(k / k_scale))``; :func:`joint_key_kl`
computes exactly that (codes multiplied in float32, scales folded into one factor), and scores it
against the exact attention ``P = softmax(q·kᵀ·scaling)`` with the attention KL of
:mod:`kvcal.search.objectives`.

Search per layer (each choice: best on the calibration split over the candidates of
:func:`kvcal.search.static_scales.candidate_scales` — absmax, unity, clips, headrooms, vLLM's old
on-the-fly rule — then the lowest held-out error among {best, absmax, unity}, as for K/V):

1. ``q_scale`` with exact keys (the KL the query quantization alone adds);
2. ``k_scale`` seeing the quantized queries of step 1 (joint KL of both quantizations);
3. ``q_scale`` again, seeing the quantized keys of step 2 (one round of coordinate descent);
4. ``v_scale`` by the attention-output objective of :func:`~kvcal.search.static_scales.choose_static_fp8`
   (values enter after the softmax; query quantization changes ``P`` only to second order).

Per-tensor granularity gives one scale of each kind per layer; ``per_head`` gives one k/v scale per KV
head and one q scale per KV-head group (what vLLM's per-head path consumes). Each KV head's KL involves
only its own query group, k and q scales, so per-head choices are made head by head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.engines.vllm.dtypes import (
    FP8_E4M3_MAX,
    fp8_static_fake_quant,
    fp8_static_quantize,
    query_fp8_fake_quant,
    vllm_backend,
)
from kvcal.formats.fp8 import get_fp8_format
from kvcal.search.guard import guarded_tensor_choice
from kvcal.search.objectives import SequenceCache, sequence_caches
from kvcal.search.static_scales import (
    ScaleChoice,
    candidate_scales,
    candidates_record,
    choose_static_fp8,
    clip_free_of,
)

#: vLLM dtypes whose static scales this module calibrates (queries quantized for both).
SUPPORTED_DTYPES = ("fp8", "fp8_e4m3")


def query_codes(q: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """FP8 codes (as float32) vLLM attends with for queries ``q`` [H_q, T, D] and ``q_scale``
    ``[H_kv]`` (one per KV-head group; a per-tensor scale repeated) — ``e4m3(sat(q·(1/q_scale)))`` as
    :func:`kvcal.engines.vllm.dtypes.query_fp8_fake_quant` writes it (its dequantized value divided by
    the scale and rounded back to e4m3, which recovers the code exactly: the division is within 2 ulp of
    float32 and e4m3 codes are 2^20 ulp apart). float32 [H_q, T, D]."""
    h_kv = q_scale.numel()
    deq = query_fp8_fake_quant(q[None], q_scale.float(), num_kv_heads=h_kv)[0]
    s = q_scale.float().repeat_interleave(q.shape[0] // h_kv).view(-1, 1, 1)
    return (deq / s).to(torch.float8_e4m3fn).float()


def key_codes(k: torch.Tensor, k_scale: torch.Tensor, backend: str = "cuda") -> torch.Tensor:
    """FP8 codes (as float32) vLLM stores for keys ``k`` [H_kv, T, D] with ``k_scale`` ``[H_kv]``:
    :func:`kvcal.engines.vllm.dtypes.fp8_static_quantize` (``e4m3(sat(k / k_scale))``, rounded to nearest on
    ``cuda``, truncated on ``cpu``)."""
    return fp8_static_quantize(k[None], k_scale.float(), backend=backend)[0].float()


def write_path(backend: str):
    """``fake_quant(x [H, T, D], scale [H, 1, 1])`` of the static e4m3 cache write of ``backend``, for
    :func:`kvcal.search.static_scales.choose_static_fp8`; ``None`` for ``cuda`` (its default, the
    round-to-nearest write, is already what the GPU kernels do)."""
    if vllm_backend(backend).name == "cuda":
        return None
    return lambda x, scale: fp8_static_fake_quant(x[None], scale.reshape(-1), backend=backend)[0]


def joint_key_kl(cache: SequenceCache, q_hat: torch.Tensor | None, q_scale: torch.Tensor | None,
                 k_hat: torch.Tensor | None, k_scale: torch.Tensor | None) -> torch.Tensor:
    """``Σ KL(P ‖ P̂)`` per KV head (nats, float64 ``[H_kv]``) over the cache's evaluated queries.

    ``P``: exact attention of ``cache`` (float32 queries and keys). ``P̂ = softmax(s)`` with
    ``s = (q_hat · k_hatᵀ) · scaling · q_scale · k_scale`` (vLLM's folding of both scales into the
    softmax scale, see the module docstring). ``q_hat`` [H_q, Tq, D]: FP8 codes of the evaluated queries
    ``cache.q[:, cache.qpos]`` (:func:`query_codes` of them) and ``q_scale`` ``[H_kv]``, or ``None`` for exact
    queries (scale 1); likewise ``k_hat`` [H_kv, T, D] (all keys) / ``k_scale``."""
    h_kv = cache.k.shape[0]
    q = cache.q[:, cache.qpos] if q_hat is None else q_hat
    k = cache.k if k_hat is None else k_hat
    fold = torch.full((h_kv,), float(cache.scaling), dtype=torch.float32)
    if q_scale is not None:
        fold = fold * q_scale.float()
    if k_scale is not None:
        fold = fold * k_scale.float()
    qg = q.float().reshape(h_kv, -1, cache.qpos.numel(), q.shape[-1])
    return cache.scores_kl(torch.einsum("hgqd,htd->hgqt", qg, k.float()).mul_(fold.view(-1, 1, 1, 1)))


def _errors(caches: list[SequenceCache], which: str, scales: torch.Tensor, other: torch.Tensor | None,
            quantize_other: bool, backend: str = "cuda") -> torch.Tensor:
    """Summed joint KL ``[C, H_kv]`` over ``caches`` for each candidate row of ``scales`` ``[C, H_kv]``.
    ``which``: ``"q"`` (candidates are q scales; ``other`` the k scale, or exact keys when
    ``quantize_other`` is False) or ``"k"`` (candidates are k scales; ``other`` the q scale)."""
    C, H = scales.shape
    num = torch.zeros(C, H, dtype=torch.float64)
    for c in caches:
        if which == "q":
            kh, ks = (key_codes(c.k, other, backend), other) if quantize_other else (None, None)
            for i in range(C):
                num[i] += joint_key_kl(c, query_codes(c.q[:, c.qpos], scales[i]), scales[i], kh, ks)
        else:
            qh, qs = (query_codes(c.q[:, c.qpos], other), other) if quantize_other else (None, None)
            for i in range(C):
                num[i] += joint_key_kl(c, qh, qs, key_codes(c.k, scales[i], backend), scales[i])
    return num


def _choose(calib, heldout, amax: torch.Tensor, side: str, which: str, other, quantize_other: bool,
            per_head: bool, backend: str = "cuda") -> ScaleChoice:
    """One selection (calibration best, then held-out guard among {best, absmax, unity}); ``amax``
    ``[H_kv]`` (already reduced to what one scale covers). Errors normalized per evaluated query."""
    H = amax.numel()
    fmt = get_fp8_format("fp8_e4m3")
    if not per_head:
        amax = amax.double().max().expand(H)
    labels, scales = candidate_scales(amax.double(), fmt, side)
    den_c = float(sum(c.num_queries for c in calib)) * (1 if per_head else H)
    held = heldout if heldout else calib
    den_h = float(sum(c.num_queries for c in held)) * (1 if per_head else H)
    if per_head:
        num_c = _errors(calib, which, scales, other, quantize_other, backend)  # [C, H]
        best = num_c.argmin(0)
        cand = torch.stack([best, torch.zeros(H, dtype=torch.long), torch.ones(H, dtype=torch.long)])
        num_h = _errors(held, which, scales.gather(0, cand), other, quantize_other, backend)  # [3, H]
        pick = num_h.argmin(0)
        final = cand.gather(0, pick[None])[0]
        scale = scales.gather(0, final[None])[0]
        fig_h = {"chosen": float(num_h.gather(0, pick[None])[0].mean() / den_h),
                 "absmax": float(num_h[1].mean() / den_h), "unity": float(num_h[2].mean() / den_h)}
        fig_c = {"chosen": float(num_c.gather(0, final[None])[0].mean() / den_c),
                 "absmax": float(num_c[0].mean() / den_c), "unity": float(num_c[1].mean() / den_c)}
        lab = [labels[i] for i in final.tolist()]
        amax_out = amax.float()
    else:
        g = guarded_tensor_choice(lambda caches, rows: _errors(caches, which, rows, other, quantize_other, backend),
                                  calib, heldout, scales, den_c, den_h)
        final, fig_h, fig_c = g.index, g.heldout, g.calib
        scale = scales[final, :1]
        lab = [labels[final]]
        amax_out = amax[:1].float()
    clip = (scale.double() * fmt.max / amax_out.double()).float()
    choice = ScaleChoice(scale=scale.float(), label=lab, clip_ratio=clip, heldout=fig_h, calib=fig_c, amax=amax_out)
    if which != "q":  # the cache's k/v scales: also the clip-free choice a non-saturating engine is exported
        choice.clip_free = clip_free_of(
            choice, labels, scales, amax.float(), fmt.max,
            lambda caches, rows: _errors(caches, which, rows, other, quantize_other, backend),
            calib, heldout, num_c if per_head else g.num_c, per_head,
            den_c * (H if per_head else 1), den_h * (H if per_head else 1))
        if not per_head:
            choice.candidates = candidates_record(labels, scales, g.num_c, den_c)
    return choice


def choose_key_scale(calib: list[SequenceCache], heldout: list[SequenceCache], k_head_absmax: torch.Tensor,
                     q_scale: torch.Tensor | None, per_head: bool, backend: str = "cuda") -> ScaleChoice:
    """The ``k_scale`` (``[1]`` or ``[H_kv]``) that minimizes the attention KL vLLM serves when the queries are
    FP8 with ``q_scale`` (float ``[1]``/``[H_kv]``; ``None``: exact queries, as a backend without query
    quantization). ``k_head_absmax`` ``[H_kv]``. ``backend``: whose key write is scored (``cpu``: truncation).
    Errors: joint KL per evaluated query, nats."""
    H = k_head_absmax.numel()
    if q_scale is None:
        return _choose(calib, heldout, k_head_absmax, "k", "k", None, False, per_head, backend)
    return _choose(calib, heldout, k_head_absmax, "k", "k", _expand(q_scale, H), True, per_head)


def choose_query_scale(calib: list[SequenceCache], heldout: list[SequenceCache], q_group_absmax: torch.Tensor,
                       k_scale: torch.Tensor | None, per_head: bool) -> ScaleChoice:
    """The ``q_scale`` (``[1]`` or ``[H_kv]``, one per KV-head group) minimizing the attention KL with FP8 queries
    and keys FP8 at ``k_scale`` (``None``: exact keys). ``q_group_absmax`` ``[H_kv]`` (:func:`group_absmax`).
    Candidates: :func:`~kvcal.search.static_scales.candidate_scales` on the query absmax (the on-the-fly
    row is ``amax/200``, vLLM's old ``calculate_kv_scales`` rule for queries)."""
    H = q_group_absmax.numel()
    if k_scale is None:
        return _choose(calib, heldout, q_group_absmax, "k", "q", None, False, per_head)
    return _choose(calib, heldout, q_group_absmax, "k", "q", _expand(k_scale, H), True, per_head)


def _expand(scale: torch.Tensor, H: int) -> torch.Tensor:
    return scale.float().reshape(-1).expand(H).contiguous() if scale.numel() == 1 else scale.float().reshape(-1)


def group_absmax(q_head_absmax: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per-KV-head-group query absmax ``[H_kv]`` from per-query-head absmax ``[H_q]`` (query head ``j``
    reads KV head ``j // (H_q / H_kv)``, as in :mod:`kvcal.search.objectives`)."""
    return q_head_absmax.float().reshape(num_kv_heads, -1).amax(1)


@dataclass
class VllmFP8Choice:
    """The scales of one layer: ``q``, ``k``, ``v`` :class:`ScaleChoice` (``q``'s errors: KL with quantized
    queries and exact keys on the first pass, then with the chosen keys; ``k``'s: the joint KL with the
    step-1 queries). ``q_only``: held-out KL per query that query quantization alone adds at the chosen
    ``q_scale`` (exact keys); ``kv_only``: with the chosen ``k_scale`` and exact queries."""

    q: ScaleChoice
    k: ScaleChoice
    v: ScaleChoice
    q_only: float
    kv_only: float


def choose_layer(calib: list[SequenceCache], heldout: list[SequenceCache], q_head_absmax: torch.Tensor,
                 k_head_absmax: torch.Tensor, v_head_absmax: torch.Tensor, per_head: bool,
                 quantize_query: bool = True, backend: str = "cuda") -> VllmFP8Choice:
    """Choose one layer's ``q_scale``/``k_scale``/``v_scale`` for vLLM ``--kv-cache-dtype fp8`` (steps of the
    module docstring). ``calib``/``heldout``: :class:`~kvcal.search.objectives.SequenceCache` per captured
    sequence (``heldout`` empty: the guard uses the calibration split). ``*_head_absmax``: observed absmax
    per query head ``[H_q]`` and per KV head ``[H_kv]`` (calibration statistics). ``per_head``: one scale
    per KV head / KV-head group, else one per tensor. ``quantize_query`` False: keys searched against exact
    queries (what the existing K/V search does) and ``q`` left at the absmax rule — for comparisons, and for
    a backend without query quantization. ``backend``: the write path scored for keys and values
    (:data:`kvcal.engines.vllm.dtypes.VLLM_BACKENDS`; ``cpu`` truncates and quantizes no query, so it needs
    ``quantize_query`` False)."""
    H = k_head_absmax.numel()
    qa = group_absmax(q_head_absmax, H)
    if quantize_query and not vllm_backend(backend).quantizes_query:
        raise ValueError(f"backend {backend} quantizes no query; pass quantize_query=False")
    if quantize_query:
        q1 = choose_query_scale(calib, heldout, qa, None, per_head)
        k = choose_key_scale(calib, heldout, k_head_absmax, q1.scale, per_head)
        q = choose_query_scale(calib, heldout, qa, k.scale, per_head)
    else:  # the K search of kvcal.search.static_scales (exact queries); q at the absmax rule
        k = choose_key_scale(calib, heldout, k_head_absmax, None, per_head, backend)
        a = (qa if per_head else qa.max().reshape(1)).float()
        q = ScaleChoice(scale=a / FP8_E4M3_MAX, label=["absmax"] * a.numel(), clip_ratio=torch.ones_like(a),
                       heldout={}, calib={}, amax=a)
    v = choose_static_fp8(calib, heldout, v_head_absmax, "v", get_fp8_format("fp8_e4m3"), per_head,
                          write_path(backend))
    held = heldout if heldout else calib
    nq = float(sum(c.num_queries for c in held)) * H
    qs, ks = _expand(q.scale, H), _expand(k.scale, H)
    q_only = sum(float(joint_key_kl(c, query_codes(c.q[:, c.qpos], qs), qs, None, None).sum()) for c in held) / nq
    kv_only = sum(float(joint_key_kl(c, None, None, key_codes(c.k, ks, backend), ks).sum()) for c in held) / nq
    return VllmFP8Choice(q=q, k=k, v=v, q_only=q_only, kv_only=kv_only)


def search_vllm_fp8(cap, per_head: bool, max_queries: int = 96, progress: bool = True,
                    quantize_query: bool | None = None, backend: str = "cuda") -> list[dict]:
    """:func:`choose_layer` for every layer of a :class:`~kvcal.capture.run.CaptureResult`. Returns rows
    ``{"layer", "k", "v", "q": ScaleChoice, "q_only", "kv_only"}`` (``k``/``v`` as
    :func:`kvcal.search.fp8.search_scales` rows, so :func:`kvcal.search.fp8.plan_from_choices` builds the plan)."""
    from tqdm.auto import tqdm

    if quantize_query is None:  # as the backend does
        quantize_query = vllm_backend(backend).quantizes_query
    out = []
    for layer in tqdm(range(len(cap.stats.k)), desc="search (vllm fp8)", disable=not progress):
        calib = sequence_caches(cap.calib, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0))
        held = sequence_caches(cap.heldout, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0)) if cap.heldout.items else []
        st = {s: getattr(cap.stats, s)[layer].finalize()["head_absmax"] for s in ("q", "k", "v")}
        ch = choose_layer(calib, held, st["q"], st["k"], st["v"], per_head, quantize_query, backend)
        out.append({"layer": layer, "k": ch.k, "v": ch.v, "q": ch.q, "q_only": ch.q_only, "kv_only": ch.kv_only})
    return out


def q_scale_tensor(choice: ScaleChoice, per_head: bool, num_kv_heads: int) -> torch.Tensor:
    """The artifact tensor ``model.layers.{i}.self_attn.q_scale``: float32 ``[1]`` (per tensor) or
    ``[H_kv, 1, 1]`` (one per KV-head group; exported to vLLM as ``[H_q, 1, 1]``)."""
    s = choice.scale.float().reshape(-1)
    return s[:1].clone() if not per_head else s.expand(num_kv_heads).reshape(num_kv_heads, 1, 1).clone()


def vllm_metadata(rows: list[dict], kv_cache_dtype: str, per_head: bool, backend: str = "cuda") -> dict:
    """The artifact's ``vllm`` metadata section: engine, backend (whose write path was calibrated), dtype,
    skipped layers (none: every layer's cache is FP8), query quantization and the q scales, with held-out KL
    figures per layer."""
    b = vllm_backend(backend)
    return {
        "engine": "vllm", "vllm_version": "0.33.0", "kv_cache_dtype": kv_cache_dtype, "skip_layers": [],
        "backend": b.name, "fp8_write": "truncate" if b.fp8_rounding == "truncate" else "round to nearest even",
        "query_quantization": ("fp8_e4m3 static q_scale " + ("per KV-head group" if per_head else "per tensor")
                               if b.quantizes_query else f"none (backend {b.name} reads the model-dtype query)"),
        "q_scale": [r["q"].scale.reshape(-1).tolist() for r in rows],
        "heldout_kl_query_only": [r["q_only"] for r in rows],
        "heldout_kl_kv_only": [r["kv_only"] for r in rows],
        "heldout_kl_joint": [(r["q"] if b.quantizes_query else r["k"]).heldout["chosen"] for r in rows],
    }


def add_to_artifact(rows: list[dict], tensors: dict, meta: dict, kv_cache_dtype: str, per_head: bool,
                    num_kv_heads: int, backend: str = "cuda") -> None:
    """Record what :func:`search_vllm_fp8` chose beyond K/V in the artifact being written: the
    ``model.layers.{i}.self_attn.q_scale`` tensors (:func:`q_scale_tensor`), ``layers[i].q`` (scale, amax,
    candidate, held-out/calibration KL) and the ``vllm`` section (:func:`vllm_metadata`); the
    ``calibration`` section names the objectives. Mutates ``tensors`` and ``meta``."""
    quantizes_query = vllm_backend(backend).quantizes_query
    for r, lm in zip(rows, meta["layers"], strict=True):
        q = r["q"]
        if not quantizes_query:  # no q_scale: the backend reads none, and a GPU deployment keeps vLLM's 1.0
            continue
        tensors[f"model.layers.{r['layer']}.self_attn.q_scale"] = q_scale_tensor(q, per_head, num_kv_heads)
        lm["q"] = {"scale": q.scale.tolist(), "amax": q.amax.tolist(), "clip_ratio": q.clip_ratio.tolist(),
                   "candidate": q.label, "heldout": q.heldout, "calib": q.calib}
    meta["vllm"] = vllm_metadata(rows, kv_cache_dtype, per_head, backend)
    cal = meta["calibration"]
    if not quantizes_query:
        cal["method"] = (f"attention-aware static scale search for vLLM --kv-cache-dtype {kv_cache_dtype}, backend "
                         f"{vllm_backend(backend).name} (FP8 written by truncation, queries not quantized)")
        cal["objective_k"] = "attention KL (nats per query) of exact queries against truncated FP8 key codes x k_scale"
        return
    cal["method"] = f"attention-aware static scale search for vLLM --kv-cache-dtype {kv_cache_dtype} (FP8 queries)"
    cal["objective_k"] = ("attention KL (nats per query) of vLLM's scores (FP8 query codes . FP8 key codes) x "
                          "softmax scale x q_scale x k_scale against the exact attention")
    cal["objective_q"] = ("the same joint KL: q_scale with exact keys, then k_scale with those queries, then "
                          "q_scale again with the chosen keys")


__all__ = ["SUPPORTED_DTYPES", "query_codes", "key_codes", "joint_key_kl", "group_absmax", "choose_layer",
           "choose_key_scale", "choose_query_scale", "add_to_artifact",
           "search_vllm_fp8", "q_scale_tensor", "vllm_metadata", "VllmFP8Choice"]

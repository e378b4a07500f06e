"""NVFP4 outer scales (and ``q_scale``) for vLLM 0.33's ``--kv-cache-dtype nvfp4`` (torch only).

What vLLM does (0.33.0 wheel, paths inside ``vllm/``; line numbers of that release):

* **Where the outer scale comes from.** An NVFP4 cache has no scale tensors of its own: the static outer
  (global) scale of each layer's K and V is the attention layer's ``k_scale`` / ``v_scale`` — the same
  checkpoint tensors ``{attn}.k_scale`` / ``{attn}.v_scale`` an FP8 cache reads. FlashInfer's store
  passes ``layer._k_scale`` / ``layer._v_scale`` to ``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping``
  (fa2 path) or ``reshape_and_cache_flash`` (trtllm-gen path), ``v1/attention/backends/flashinfer.py``
  :2822-2856, and folds the floats into the kernel scales: ``bmm1_scale = sm_scale · q_scale · k_scale``,
  ``bmm2_scale = v_scale`` (:2223-2231; fa2 prefill ``k_scale=`` / ``v_scale=`` :2446-2451). Per block the
  cache holds E2M1 values and an e4m3 block scale computed at write time with ``global_scale =
  1/outer`` (``ref_nvfp4_quant``, ``model_executor/layers/quantization/utils/nvfp4_emulation_utils.py``
  :709-723), emulated by :func:`kvcal.engines.vllm.dtypes.nvfp4_quantize`.
* **Per tensor only.** ``BaseKVCacheMethod.process_weights_after_loading``
  (``model_executor/layers/quantization/kv_cache.py`` :117-145) raises "Only support per-tensor scaling
  factor" for a non-scalar k/v scale; compressed-tensors ``attn_head`` scales reach FlashInfer as their
  max (``compressed_tensors/compressed_tensors.py`` :1261-1270, ``_to_scalar``). So one outer scale per
  layer and side.
* **Missing scales are 1.0.** ``set_default_quant_scales`` (``model_executor/layers/attention/attention.py``
  :133-151) starts every layer at 1.0; without a quantization config no scale parameter exists, and a
  compressed-tensors config initializes ones (``compressed_tensors.py`` :1159-1167); the generic method
  maps a missing k/v pair to 1.0 and a missing ``q_scale`` to 1.0 (``kv_cache.py`` :125-129, :171-176).
* **Queries.** ``Attention.__init__`` builds an FP8 ``query_quant`` for ``nvfp4*`` caches when the backend
  ``supports_quant_query_input`` (``attention.py`` :470-488; its forward quantizes with ``_q_scale``,
  :511-526). FlashInfer sets that only on SM100 (trtllm-gen; ``flashinfer.py`` :2076-2084), where
  NVFP4 "requires FP8 quantized queries" (:2497-2502) and ``get_q_data_type`` returns e4m3 (:1166-1169).
  On SM80/SM90/SM120 the NVFP4 cache runs FlashInfer fa2 (``_nvfp4_kv_on_fa2``, :114-115), the query
  "stays in the model dtype" and ``q_scale=1.0`` is passed (:2446-2448, :2636-2638). ``nvfp4_4over6``
  runs only on trtllm-gen (:655-658). kvcal therefore calibrates ``q_scale`` for the SM100 path (the
  keys' search sees FP8 queries) and records both figures; on the fa2 path vLLM ignores ``q_scale``.
* **The amax rule.** The usual NVFP4 global dequantization scale is ``amax / (448 · 6)`` (e4m3 max ×
  E2M1 max: ``third_party/fmha_sm100/cute/quantize.py`` :145-158 ``nvfp4_global_scale_from_amax``;
  ModelOpt's ``amax/2688``, ``model_executor/layers/quantization/modelopt.py`` :2092). With it the
  largest block's e4m3 scale is 448 and no block scale saturates on the calibration data.

What the outer scale changes. Scaling it by ``2^n`` moves every block scale by ``2^-n`` and changes
nothing but which blocks fall into the e4m3 block scale's subnormals (small blocks lose precision, or
become 0 below ``2^-10``) or saturate at 448 (large blocks clip). A non-power-of-two factor also moves
where each block's ``amax/6/outer`` falls on e4m3's 3-bit mantissa grid, i.e. how each block scale
rounds (up: a coarser E2M1 grid; down: the block's largest values clip at 6). Both effects depend on the
data, so the scale is chosen by what attention sees:

* keys: the attention KL of vLLM's scores ``(q̂c · k̂c) · scaling · q_scale · k_scale`` against the exact
  attention on the real captured queries (:func:`kvcal.engines.vllm.search_fp8.joint_key_kl`, with NVFP4 key codes
  ``e2m1 · block_scale`` from :func:`key_codes`);
* values: the relative attention-output error ``Σ‖P(V̂−V)‖² / Σ‖PV‖²``
  (:meth:`kvcal.search.objectives.SequenceCache.value_error`);
* ``q_scale``: FP8 queries as for ``--kv-cache-dtype fp8`` (:func:`kvcal.engines.vllm.search_fp8.choose_query_scale`
  with exact keys, then again against the chosen NVFP4 keys).

Candidates (:func:`outer_candidates`): the amax rule, unity (1.0, vLLM's default), and the amax rule times
``2^(j/8)`` for ``j = -4..7`` (one octave of alignment with the e4m3 grid, from clipping the largest blocks
at ``2^-0.5`` to a ``2^0.875`` headroom). The choice: best on the calibration split, then the lowest
held-out error among {best, amax rule, unity} (:func:`kvcal.search.guard.guarded_tensor_choice`), so it
is never worse than either on the held-out check.
"""

from __future__ import annotations

import torch

from kvcal.engines.vllm.dtypes import E2M1_MAX, FP8_E4M3_MAX, NVFP4_BLOCK, nvfp4_fake_quant, nvfp4_quantize
from kvcal.engines.vllm.search_fp8 import (
    VllmFP8Choice,
    choose_query_scale,
    group_absmax,
    joint_key_kl,
    query_codes,
)
from kvcal.search.guard import guarded_tensor_choice
from kvcal.search.objectives import SequenceCache, sequence_caches
from kvcal.search.static_scales import ScaleChoice

#: vLLM dtypes whose outer scales this module calibrates.
SUPPORTED_DTYPES = ("nvfp4",)
#: The amax rule's divisor: e4m3 max x E2M1 max (outer = amax / 2688).
NVFP4_AMAX_DIVISOR = FP8_E4M3_MAX * E2M1_MAX
#: Exponents ``j`` of the ``amax rule x 2^(j/8)`` candidates.
OCTAVE_STEPS = tuple(j for j in range(-4, 8) if j != 0)

#: Checkpoint-free names of the artifact tensors (one float32 ``[1]`` per layer).
OUTER_TENSOR = "model.layers.{i}.self_attn.{side}_outer_scale"


def outer_tensor_name(layer: int, side: str) -> str:
    """The artifact tensor holding ``layer``'s NVFP4 outer scale for ``side`` (``"k"``/``"v"``):
    ``model.layers.{i}.self_attn.{k,v}_outer_scale`` (exported to vLLM as ``{attn}.k_scale``/``.v_scale``)."""
    return OUTER_TENSOR.format(i=layer, side=side)


def outer_candidates(amax: float, num_kv_heads: int) -> tuple[list[str], torch.Tensor]:
    """Labels and candidate outer scales, float32 ``[C, H_kv]`` (each row one per-tensor value repeated for
    the ``H_kv`` heads, as the guard sums per-head errors). Row 0 ``absmax`` = ``amax / 2688`` (1.0 for
    ``amax`` 0), row 1 ``unity`` = 1.0, then ``absmax*2^(j/8)`` for :data:`OCTAVE_STEPS`. ``amax``: the
    layer's calibration absmax of the side (a float, units of K or V)."""
    base = float(amax) / NVFP4_AMAX_DIVISOR if amax > 0 else 1.0
    labels = ["absmax", "unity"] + [f"absmax*2^({j}/8)" for j in OCTAVE_STEPS]
    vals = [base, 1.0] + [base * 2.0 ** (j / 8) for j in OCTAVE_STEPS]
    return labels, torch.tensor(vals, dtype=torch.float64).float()[:, None].expand(-1, num_kv_heads).contiguous()


def key_codes(k: torch.Tensor, outer: torch.Tensor | float) -> torch.Tensor:
    """What vLLM's attention multiplies the queries with for keys ``k`` [H_kv, T, D] stored as NVFP4 with
    outer scale ``outer``: ``e2m1 · block_scale`` per element (float32 [H_kv, T, D]), the outer scale left
    to the softmax scale (``bmm1_scale``). Exact in float32 (a 2-significant-bit E2M1 value times a
    4-significant-bit e4m3 scale), so ``key_codes(k, o) · o`` is :func:`~kvcal.engines.vllm.dtypes.nvfp4_fake_quant`."""
    H, T, D = k.shape
    e, s8 = nvfp4_quantize(k[None], float(outer) if not isinstance(outer, torch.Tensor) else outer.reshape(-1)[:1])
    return (e.reshape(H, T, D // NVFP4_BLOCK, NVFP4_BLOCK) * s8.float().reshape(H, T, D // NVFP4_BLOCK, 1)
            ).reshape(H, T, D)


def _key_errors(caches: list[SequenceCache], rows: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    """Σ joint KL ``[c, H_kv]`` over ``caches`` for each candidate outer scale row of ``rows`` ``[c, H_kv]``,
    queries FP8 at ``q_scale`` (``[H_kv]``, or ``None``: exact)."""
    C, H = rows.shape
    num = torch.zeros(C, H, dtype=torch.float64)
    for c in caches:
        qh, qs = (query_codes(c.q[:, c.qpos], q_scale), q_scale) if q_scale is not None else (None, None)
        for i in range(C):
            num[i] += joint_key_kl(c, qh, qs, key_codes(c.k, rows[i, 0]), rows[i])
    return num


def _query_errors(caches: list[SequenceCache], rows: torch.Tensor, k_outer: torch.Tensor) -> torch.Tensor:
    """Σ joint KL ``[c, H_kv]`` for each candidate q scale row, keys NVFP4 at outer scale ``k_outer`` ``[H_kv]``."""
    C, H = rows.shape
    num = torch.zeros(C, H, dtype=torch.float64)
    for c in caches:
        kh = key_codes(c.k, k_outer[0])
        for i in range(C):
            num[i] += joint_key_kl(c, query_codes(c.q[:, c.qpos], rows[i]), rows[i], kh, k_outer)
    return num


def _value_errors(caches: list[SequenceCache], rows: torch.Tensor) -> torch.Tensor:
    """Σ‖P(V̂−V)‖² ``[c, H_kv]`` for each candidate outer scale row (V̂: NVFP4 at that outer scale)."""
    C, H = rows.shape
    num = torch.zeros(C, H, dtype=torch.float64)
    for c in caches:
        for i in range(C):
            num[i] += c.value_error(nvfp4_fake_quant(c.v[None], float(rows[i, 0]))[0])[0]
    return num


def _side_choice(labels, rows, pick, amax: float, divisor: float) -> ScaleChoice:
    scale = rows[pick.index, :1].float().clone()
    a = torch.tensor([float(amax)], dtype=torch.float32)
    clip = (scale.double() * divisor / a.double().clamp_min(torch.finfo(torch.float32).tiny)).float()
    return ScaleChoice(scale=scale, label=[labels[pick.index]], clip_ratio=clip, heldout=pick.heldout,
                      calib=pick.calib, amax=a)


def choose_outer_scale(calib: list[SequenceCache], heldout: list[SequenceCache], amax: float, side: str,
                       q_scale: torch.Tensor | None = None) -> ScaleChoice:
    """The per-tensor NVFP4 outer scale of one layer's keys (``side='k'``: attention KL per evaluated query,
    nats, with FP8 queries at ``q_scale`` ``[1]``/``[H_kv]``, ``None`` for exact queries) or values
    (``'v'``: relative attention-output error). ``amax``: the side's calibration absmax (all heads).
    ``ScaleChoice.clip_ratio`` is ``scale · 2688 / amax`` (1 for the amax rule). ``heldout`` empty: the
    guard runs on the calibration split."""
    H = calib[0].k.shape[0]
    labels, rows = outer_candidates(amax, H)
    held = heldout if heldout else calib
    if side == "k":
        qs = None if q_scale is None else q_scale.float().reshape(-1).expand(H).contiguous()
        den_c = float(sum(c.num_queries for c in calib)) * H
        den_h = float(sum(c.num_queries for c in held)) * H
        pick = guarded_tensor_choice(lambda cs, r: _key_errors(cs, r, qs), calib, heldout, rows, den_c, den_h)
    elif side == "v":
        den_c = float(sum(float(c.out_sq.sum()) for c in calib))
        den_h = float(sum(float(c.out_sq.sum()) for c in held))
        pick = guarded_tensor_choice(_value_errors, calib, heldout, rows, max(den_c, 1e-30), max(den_h, 1e-30))
    else:
        raise ValueError(f"side must be 'k' or 'v', got {side!r}")
    return _side_choice(labels, rows, pick, amax, NVFP4_AMAX_DIVISOR)


def choose_query_scale_nvfp4(calib: list[SequenceCache], heldout: list[SequenceCache], q_amax: float,
                             k_outer: torch.Tensor) -> ScaleChoice:
    """The per-tensor ``q_scale`` minimizing the attention KL with FP8 queries and NVFP4 keys at outer scale
    ``k_outer`` (``[1]``). Candidates: :func:`kvcal.search.static_scales.candidate_scales` on the query
    absmax (as for the fp8 cache); the same guard."""
    from kvcal.formats.fp8 import get_fp8_format
    from kvcal.search.static_scales import candidate_scales

    H = calib[0].k.shape[0]
    fmt = get_fp8_format("fp8_e4m3")
    labels, rows = candidate_scales(torch.tensor(float(q_amax), dtype=torch.float64).expand(H), fmt, "k")
    held = heldout if heldout else calib
    den_c = float(sum(c.num_queries for c in calib)) * H
    den_h = float(sum(c.num_queries for c in held)) * H
    ko = k_outer.float().reshape(-1)[:1].expand(H).contiguous()
    pick = guarded_tensor_choice(lambda cs, r: _query_errors(cs, r, ko), calib, heldout, rows, den_c, den_h)
    return _side_choice(labels, rows, pick, q_amax, fmt.max)


#: One layer's choices, the same record as the FP8 search's: ``k``/``v`` (here the NVFP4 outer scales) and
#: ``q`` (:class:`ScaleChoice`, per tensor); ``q_only``: held-out KL per query that FP8 queries alone add at the
#: chosen ``q_scale`` (exact keys); ``kv_only``: the NVFP4 keys at the chosen outer scale with exact queries
#: (what the SM80/90/120 fa2 path serves).
VllmNVFP4Choice = VllmFP8Choice


def choose_layer(calib: list[SequenceCache], heldout: list[SequenceCache], q_head_absmax: torch.Tensor,
                 k_head_absmax: torch.Tensor, v_head_absmax: torch.Tensor,
                 quantize_query: bool = True) -> VllmNVFP4Choice:
    """One layer's ``q_scale`` and NVFP4 outer ``k_scale``/``v_scale`` for vLLM ``--kv-cache-dtype nvfp4``:
    (1) ``q_scale`` with exact keys (:func:`kvcal.engines.vllm.search_fp8.choose_query_scale`), (2) the key outer
    scale seeing those FP8 queries, (3) ``q_scale`` again against the chosen NVFP4 keys, (4) the value outer
    scale by the attention-output error. ``*_head_absmax``: calibration absmax per query head ``[H_q]`` and
    per KV head ``[H_kv]``. ``quantize_query`` False: keys searched against exact queries (the fa2 path) and
    ``q`` left at the absmax rule ``amax/448``."""
    H = k_head_absmax.numel()
    qa = float(group_absmax(q_head_absmax, H).max())
    ka, va = float(k_head_absmax.max()), float(v_head_absmax.max())
    if quantize_query:
        q1 = choose_query_scale(calib, heldout, torch.tensor([qa]).expand(H), None, False)
        k = choose_outer_scale(calib, heldout, ka, "k", q1.scale)
        q = choose_query_scale_nvfp4(calib, heldout, qa, k.scale)
    else:
        k = choose_outer_scale(calib, heldout, ka, "k", None)
        a = torch.tensor([qa], dtype=torch.float32)
        q = ScaleChoice(scale=a / FP8_E4M3_MAX, label=["absmax"], clip_ratio=torch.ones(1), heldout={}, calib={}, amax=a)
    v = choose_outer_scale(calib, heldout, va, "v")
    held = heldout if heldout else calib
    nq = float(sum(c.num_queries for c in held)) * H
    qs = q.scale.float().reshape(-1)[:1].expand(H).contiguous()
    ks = k.scale.float().reshape(-1)[:1].expand(H).contiguous()
    q_only = sum(float(joint_key_kl(c, query_codes(c.q[:, c.qpos], qs), qs, None, None).sum()) for c in held) / nq
    kv_only = sum(float(joint_key_kl(c, None, None, key_codes(c.k, ks[0]), ks).sum()) for c in held) / nq
    return VllmNVFP4Choice(q=q, k=k, v=v, q_only=q_only, kv_only=kv_only)


def search_vllm_nvfp4(cap, max_queries: int = 96, progress: bool = True, quantize_query: bool = True) -> list[dict]:
    """:func:`choose_layer` for every layer of a :class:`~kvcal.capture.run.CaptureResult`. Returns rows
    ``{"layer", "k", "v", "q": ScaleChoice, "q_only", "kv_only"}`` (``k``/``v``: the outer scales)."""
    from tqdm.auto import tqdm

    out = []
    for layer in tqdm(range(len(cap.stats.k)), desc="search (vllm nvfp4)", disable=not progress):
        calib = sequence_caches(cap.calib, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0))
        held = sequence_caches(cap.heldout, layer, cap.scaling[layer], max_queries,
                          cap.windows.get(layer, 0)) if cap.heldout.items else []
        st = {s: getattr(cap.stats, s)[layer].finalize()["head_absmax"] for s in ("q", "k", "v")}
        ch = choose_layer(calib, held, st["q"], st["k"], st["v"], quantize_query)
        out.append({"layer": layer, "k": ch.k, "v": ch.v, "q": ch.q, "q_only": ch.q_only, "kv_only": ch.kv_only})
    return out


def plan_from_rows(rows: list[dict]):
    """The artifact's :class:`~kvcal.plan.KVPlan` (NVFP4 on both sides of every layer: the cache layout,
    block scales computed at write time, so no plan tensors) and its per-layer metadata ``layers[i]`` with
    the outer scales' search records under ``k``/``v``."""
    from kvcal.formats.spec import KVCacheConfig, TensorQuantSpec
    from kvcal.plan import KVPlan

    plan = KVPlan.uniform(len(rows), KVCacheConfig(TensorQuantSpec("nvfp4"), TensorQuantSpec("nvfp4")))
    layers_meta = []
    for r in rows:
        lm = {"layer": r["layer"]}
        for side in ("k", "v"):
            ch = r[side]
            lm[side] = {"scale": ch.scale.tolist(), "amax": ch.amax.tolist(), "clip_ratio": ch.clip_ratio.tolist(),
                        "candidate": ch.label, "heldout": ch.heldout, "calib": ch.calib}
        layers_meta.append(lm)
    return plan, layers_meta


def vllm_metadata(rows: list[dict], kv_cache_dtype: str) -> dict:
    """The artifact's ``vllm`` section: engine, dtype, skipped layers (none), query quantization, q scales,
    the outer scales, and held-out attention KL figures per layer."""
    return {
        "engine": "vllm", "vllm_version": "0.33.0", "kv_cache_dtype": kv_cache_dtype, "skip_layers": [],
        "query_quantization": ("fp8_e4m3 static q_scale per tensor on SM100 (FlashInfer trtllm-gen); on SM80/90/120 "
                               "(FlashInfer fa2) queries stay in the model dtype and q_scale is not used"),
        "q_scale": [r["q"].scale.reshape(-1).tolist() for r in rows],
        "k_outer_scale": [float(r["k"].scale.reshape(-1)[0]) for r in rows],
        "v_outer_scale": [float(r["v"].scale.reshape(-1)[0]) for r in rows],
        "heldout_kl_query_only": [r["q_only"] for r in rows],
        "heldout_kl_kv_only": [r["kv_only"] for r in rows],
        "heldout_kl_joint": [r["q"].heldout["chosen"] for r in rows],
    }


def add_to_artifact(rows: list[dict], tensors: dict, meta: dict, kv_cache_dtype: str) -> None:
    """Record :func:`search_vllm_nvfp4`'s choices in the artifact being written: tensors
    ``model.layers.{i}.self_attn.{k,v}_outer_scale`` and ``.q_scale`` (float32 ``[1]``), ``layers[i].q``,
    the ``vllm`` section (:func:`vllm_metadata`) and the ``calibration`` section's method, objectives and
    candidates. Mutates ``tensors`` and ``meta``."""
    for r, lm in zip(rows, meta["layers"], strict=True):
        i = r["layer"]
        for side in ("k", "v"):
            tensors[outer_tensor_name(i, side)] = r[side].scale.float().reshape(1).clone()
        q = r["q"]
        tensors[f"model.layers.{i}.self_attn.q_scale"] = q.scale.float().reshape(1).clone()
        lm["q"] = {"scale": q.scale.tolist(), "amax": q.amax.tolist(), "clip_ratio": q.clip_ratio.tolist(),
                   "candidate": q.label, "heldout": q.heldout, "calib": q.calib}
    meta["vllm"] = vllm_metadata(rows, kv_cache_dtype)
    cal = meta["calibration"]
    cal["method"] = (f"attention-aware NVFP4 outer-scale search for vLLM --kv-cache-dtype {kv_cache_dtype} "
                     "(FP8 queries); the kv section is the cache layout, the per-layer outer scales are the "
                     "{k,v}_outer_scale tensors (exported as vLLM's k_scale/v_scale)")
    cal["objective_k"] = ("attention KL (nats per query) of vLLM's scores (FP8 query codes . NVFP4 key codes) x "
                          "softmax scale x q_scale x k_outer_scale against the exact attention")
    cal["objective_v"] = "relative attention-output error sum|P(V^-V)|^2 / sum|PV|^2, V^ NVFP4 at the outer scale"
    cal["objective_q"] = ("the same joint KL: q_scale with exact keys, then the key outer scale with those queries, "
                          "then q_scale again with the chosen keys")
    cal["candidates"] = ("outer scale: absmax (amax/2688), unity, absmax x 2^(j/8) for j = "
                         + ", ".join(str(j) for j in OCTAVE_STEPS) + "; q_scale: as for fp8")


__all__ = ["SUPPORTED_DTYPES", "NVFP4_AMAX_DIVISOR", "OCTAVE_STEPS", "outer_tensor_name", "outer_candidates",
           "key_codes", "choose_outer_scale", "choose_query_scale_nvfp4", "choose_layer", "VllmNVFP4Choice",
           "search_vllm_nvfp4", "plan_from_rows", "vllm_metadata", "add_to_artifact"]

"""Fitting the per-layer tables an integer side stores, on the calibration split (torch only):
query-aware rounding matrices (:func:`query_rounding`), per-channel key widths by reverse
water-filling (:func:`channel_bit_allocation`), log8 scale bases, non-uniform level tables
(:func:`fit_levels`, Lloyd) and trellis tables (:func:`fit_trellis`). :func:`kvcal.search.optimizer.search_side`
fits them and keeps each only where it measures better on held-out data."""

from __future__ import annotations

import torch

from kvcal.formats.codes import TRELLIS_UNIT, check_levels, check_trellis
from kvcal.formats.granularity import PerChannelTokenGroup, PerTokenGroup
from kvcal.formats.scales import log8_base, log8_decode, log8_encode, params_from_range
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.transforms import Transform, apply_transform
from kvcal.formats.variants import ScaleCoding
from kvcal.search.objectives import SequenceCache


def query_rounding(caches: list[SequenceCache], transform: Transform = Transform.NONE, rope=None) -> torch.Tensor:
    """Query-aware rounding matrix ``Ũ [H_kv, D, D]`` (float32, unit diagonal, float8-e4m3 ratios
    above it, as the runtime stores it: :func:`kvcal.formats.codes.unit_rounding`) for a key side,
    from the calibration sequences' queries.

    ``Σ_h = Σ q qᵀ`` over every position of every query head reading KV head ``h`` (GQA group),
    in the domain the keys are quantized in (``pre_rope``: queries un-rotated at their positions,
    so ``Σ`` ignores the relative rotation between query and key; ``hadamard``: rotated), then
    :func:`kvcal.formats.codes.rounding_matrix`. Rounding keys to minimize ``E[(qᵀΔk)²]`` is the
    OPTQ objective with the query as the layer input (Frantar et al. 2023)."""
    from kvcal.formats.codes import rounding_matrix, unit_rounding

    return unit_rounding(rounding_matrix(_query_moment(caches, transform, rope)))


def _quantized_domain(caches: list[SequenceCache], side: str, transform: Transform = Transform.NONE, rope=None, sinks: int = 0):
    """Each calibration sequence's keys (``side="k"``) or values ``[H, T, D]`` float32 after the first
    ``sinks`` tokens, in the domain they are quantized in (after ``transform``); sequences with no
    token left are skipped."""
    for c in caches:
        x = (c.k if side == "k" else c.v).float()[None, :, sinks:]
        if x.shape[2] == 0:
            continue
        yield (apply_transform(transform, x, rope=rope, start=sinks) if transform != Transform.NONE else x)[0]


def _query_moment(caches: list[SequenceCache], transform: Transform = Transform.NONE, rope=None) -> torch.Tensor:
    """``Σ_h = Σ q qᵀ`` ``[H_kv, D, D]`` float64 over every query of the GQA group of KV head ``h``,
    in the domain the keys are quantized in (see :func:`query_rounding`)."""
    sig = None
    for c in caches:
        Hk = c.k.shape[0]
        q = c.q.float()[None]  # [1, H_q, T, D]
        if transform != Transform.NONE:
            q = apply_transform(transform, q, rope=rope, start=0)
        qg = q[0].reshape(Hk, -1, q.shape[-1]).double()  # [H_kv, G*T, D]
        m = torch.einsum("hti,htj->hij", qg, qg)
        sig = m if sig is None else sig + m
    return sig


def water_fill_bits(weight: torch.Tensor, bits: int, min_bits: int = 1, max_bits: int = 8) -> torch.Tensor:
    """Integer per-channel widths ``[H, D]`` (int64) with ``Σ_c = bits · D`` per head that minimize
    ``Σ_c weight[h, c] / (2^{w_c} − 1)²`` — the summed squared step of asymmetric uniform quantizers
    whose channel ``c`` spans a range ``√weight`` (reverse water-filling, Cover & Thomas §10.3.3,
    on the integer grid).

    ``weight`` ``[H, D]``: non-negative, finite. Greedy: every channel starts at ``min_bits`` and each
    further bit goes to the channel whose distortion drops most (exact for this separable convex
    objective); ties go to the channel with the fewest bits, then the lowest index (so equal
    weights, all-zero ones included, give uniform widths). Raises ``ValueError`` for bad weights or a
    budget outside ``[min_bits, max_bits]``."""
    if weight.ndim != 2 or not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
        raise ValueError("weight must be a finite, non-negative [H, D] tensor")
    if not (1 <= min_bits <= bits <= max_bits <= 8):
        raise ValueError(f"need 1 <= min_bits <= bits <= max_bits <= 8, got {min_bits}, {bits}, {max_bits}")
    w = weight.double()
    H, D = w.shape
    out = torch.full((H, D), min_bits, dtype=torch.int64)

    def dist(b):
        return 1.0 / (2.0 ** b.double() - 1) ** 2

    rows = torch.arange(H)
    for _ in range((bits - min_bits) * D):
        gain = w * (dist(out) - dist(out + 1))
        gain = torch.where(out >= max_bits, torch.full_like(gain, -1.0), gain)
        tie = gain == gain.max(-1, keepdim=True).values
        pick = torch.where(tie, -out.double(), torch.full_like(gain, -float("inf"))).argmax(-1)
        out[rows, pick] += 1
    return out


def channel_bit_allocation(caches: list[SequenceCache], spec: TensorQuantSpec, transform: Transform = Transform.NONE, rope=None,
                           sinks: int = 0) -> torch.Tensor:
    """Per-channel key widths ``[H_kv, D]`` (int64, 1–8 bits, ``spec.bits · D`` per head) from the
    calibration sequences: :func:`water_fill_bits` of ``weight = Σ_qq[c, c] · E[range_c²]``.

    ``Σ_qq[c, c]``: the queries' second moment of channel ``c`` (:func:`query_rounding`'s ``Σ``, in
    the quantized domain); ``E[range_c²]``: mean over the spec's token groups (whole sequences for
    per-channel specs) of the squared range of key channel ``c`` in that domain, after the first
    ``sinks`` tokens. The score error a key channel adds is ``q_c · Δk_c``, so its expected square
    is ``Σ_qq[c, c] · step_c² / 12`` with ``step_c = range_c / (2^{w_c} − 1)``. Raises ``ValueError``
    for a spec that is not an asymmetric per-channel int (the only layouts whose ranges are per channel)."""
    if spec.format.kind != "int" or spec.symmetric or not isinstance(spec.granularity, PerChannelTokenGroup):
        raise ValueError("per-channel bit widths need an asymmetric int spec with per-channel token groups")
    if not caches:
        raise ValueError("no calibration sequences to allocate channel bits on")
    sig = _query_moment(caches, transform, rope)
    r2 = None
    n = 0
    for k in _quantized_domain(caches, "k", transform, rope, sinks):
        tg = spec.token_group or k.shape[1]
        T = k.shape[1] // tg * tg or k.shape[1]
        kg = k[:, :T].reshape(k.shape[0], -1, min(tg, T), k.shape[-1])
        rr = ((kg.amax(2) - kg.amin(2)).double() ** 2).sum(1)  # [H, D]
        r2 = rr if r2 is None else r2 + rr
        n += kg.shape[1]
    if r2 is None:
        raise ValueError(f"the calibration sequences hold no key after the {sinks} sink tokens")
    weight = sig.diagonal(dim1=-2, dim2=-1) * (r2 / n)
    return water_fill_bits(weight, spec.bits)



def uniform_levels(bits: int) -> torch.Tensor:
    """The symmetric uniform grid as a levels table ``[2^b]``: ``[-1, -1, -(qmax-1)/qmax, …, 1]``
    (``qmax = 2^(b-1) - 1``; the one code the symmetric grid leaves unused duplicates ``-1``), i.e.
    plain symmetric min/max quantization up to the rounding of the stored scale."""
    qmax = 2 ** (bits - 1) - 1
    return torch.cat([torch.tensor([-1.0]), torch.arange(-qmax, qmax + 1, dtype=torch.float32) / qmax])


def log8_scale_base(caches: list[SequenceCache], side: str, spec: TensorQuantSpec, transform: Transform = Transform.NONE,
                    rope=None, sinks: int = 0, levels: bool = False) -> torch.Tensor:
    """Per-head base ``float32 [H]`` of log8 scales: the top code 16× above the largest per-group
    scale of the calibration split (after ``transform``, sinks excluded; ``absmax / qmax``, or
    ``absmax`` with non-uniform levels) — :func:`kvcal.formats.scales.log8_base`."""
    H = (caches[0].k if side == "k" else caches[0].v).shape[0]
    top = torch.zeros(H, dtype=torch.float64)
    for x in _quantized_domain(caches, side, transform, rope, sinks):
        top = torch.maximum(top, x.abs().amax(dim=(1, 2)).double())
    return log8_base((top / (1.0 if levels else spec.qmax)).clamp_min(1e-12))


def _log8_base_needed(spec: TensorQuantSpec, scale_base) -> bool:
    """Whether ``spec`` has log8 scales (whose codes the fit rounds its scales to); ``ValueError`` when it does
    and ``scale_base`` is missing."""
    if ScaleCoding.of(spec) is not ScaleCoding.LOG8:
        return False
    if scale_base is None:
        raise ValueError("log8 scales need their per-head base (scale_base=, log8_scale_base)")
    return True


def fit_levels(caches: list[SequenceCache], spec: TensorQuantSpec, transform: Transform = Transform.NONE, sinks: int = 0,
               iters: int = 40, scale_base: torch.Tensor | None = None) -> torch.Tensor:
    """Non-uniform levels ``float32 [H, 2^b]`` for a value side (one table per layer, the same row
    for every KV head) by Lloyd / k-means in units of each group's absmax.

    The elements ``u = x / absmax(group)`` of the calibration values ``[H, T, D]`` (after
    ``transform``, first ``sinks`` tokens excluded) are pooled over heads and tokens with equal
    weight — every token's *relative* error counts the same — and ``2^b`` levels are fitted by
    Lloyd's algorithm (initialized at the quantiles ``0, 1/(2^b−1), …, 1``; ``iters`` steps; end
    levels free, so the fit clips when that pays). KVQuant (Hooper et al., NeurIPS 2024, §3.4) fits
    its per-layer non-uniform datatype by k-means the same way (weighted by a sensitivity). Weighting
    each token by its squared scale (its absolute error), or by that times its squared attention
    weights (the value objective's expansion), measured worse on the embedded model (V-only KL
    6.1e-3 / 5.1e-3 vs 4.9e-3, 2 × 1024 wikitext windows, exploratory probe, script not kept): tokens with
    small values are often the attended ones. ``scale_base``: with log8 scales, ``u`` is taken
    relative to the stored (rounded-up) scale, as quantization will see it. Raises ``ValueError`` for specs
    :func:`~kvcal.formats.codes.check_levels` refuses or when the caches hold no tokens after the sinks."""
    n = 2**spec.bits
    H0 = caches[0].v.shape[0] if caches else 1
    check_levels(uniform_levels(spec.bits), spec, H0)  # spec check (message names the rule)
    log8 = _log8_base_needed(spec, scale_base)
    us = []
    for x in _quantized_domain(caches, "v", transform, None, sinks):
        g = spec.effective_channel_group(x.shape[-1]) if isinstance(spec.granularity, PerTokenGroup) else x.shape[-1]
        for xg in x.split(g, dim=-1):  # channel groups (the last may be shorter, as quantize pads it)
            a = xg.abs().amax(-1, keepdim=True)
            if log8:
                b = torch.as_tensor(scale_base).float().reshape(-1, 1, 1)
                a = log8_decode(log8_encode(a, b), b)
            us.append((xg / torch.where(a > 0, a, torch.ones_like(a))).flatten())
    if not us:
        raise ValueError("no value tokens after the sinks to fit levels on")
    u, _ = torch.sort(torch.cat(us).double())
    L = u[torch.linspace(0, u.numel() - 1, n, dtype=torch.float64).round().long()].clone()
    for _ in range(iters):
        idx = torch.bucketize(u, (L[1:] + L[:-1]) / 2)
        cnt = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, torch.ones_like(u))
        su = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, u)
        new, _ = torch.sort(torch.where(cnt > 0, su / cnt.clamp_min(1), L).clamp(-1, 1))
        if torch.equal(new, L):
            break
        L = new
    return L.float()[None].expand(H0, n).contiguous()


def fit_trellis(caches: list[SequenceCache], spec: TensorQuantSpec, nu: int, transform: Transform = Transform.NONE, sinks: int = 0,
                scale_base: torch.Tensor | None = None, iters: int = 16, max_elements: int = 384_000,
                seed: int = 0) -> torch.Tensor:
    """Trellis table ``float32 [2^(ν+b)]`` (int8 multiples of ``1/TRELLIS_UNIT``) for a value side.

    The calibration values ``[H, T, D]`` (after ``transform``, first ``sinks`` tokens excluded) are
    cut into rows, each divided by its stored scale — the row's RMS, rounded as quantization rounds
    it (log8 code with ``scale_base``, else float16 up) — at most ``max_elements // D`` rows are drawn
    (seeded; the budget counts elements, which the table's entries are fitted to: 6,000 rows at head_dim
    64 as before, 1,500 at 256, so a wide head does not pay 4x the Viterbi work for the same elements
    per table entry), and :func:`kvcal.formats.trellis.fit_table` fits the table (QTIP's bitshift trellis, Tseng et al.
    2024; Lloyd iterations as in TCQ codebook design, Marcellin & Fischer 1990), which is then
    rounded to the int8 grid the runtime stores. Rows of zeros are left out. Raises ``ValueError``
    for specs :func:`~kvcal.formats.codes.check_trellis` refuses or when no value rows remain."""
    from kvcal.formats import trellis as tr

    D0 = caches[0].v.shape[-1] if caches else 0
    check_trellis(torch.zeros(2 ** (nu + spec.bits)), spec, D0)
    log8 = _log8_base_needed(spec, scale_base)
    b = torch.as_tensor(scale_base).float().reshape(-1, 1, 1) if log8 else None
    rows = []
    for x in _quantized_domain(caches, "v", transform, None, sinks):
        s_st, _ = params_from_range(spec, amax=x.pow(2).mean(-1, keepdim=True).sqrt(), scale_base=b, levels=True)
        r = log8_decode(s_st, b) if log8 else s_st.float()  # [H, T, 1], as quantize stores the row's RMS
        keep = r[..., 0] > 0
        rows.append((x / torch.where(r > 0, r, torch.ones_like(r)))[keep])
    u = torch.cat(rows) if rows else torch.zeros(0, D0)
    if u.shape[0] == 0:
        raise ValueError("no non-zero value rows after the sinks to fit a trellis table on")
    g = torch.Generator().manual_seed(seed)
    u = u[torch.randperm(u.shape[0], generator=g)[:max(1, max_elements // max(D0, 1))]]
    t = tr.fit_table(u, spec.bits, nu, iters=iters, seed=seed)
    return (t * TRELLIS_UNIT).round().clamp(-127, 127) / TRELLIS_UNIT

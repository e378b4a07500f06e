"""Attention-aware search of integer KV-cache parameters, one layer and side at a time (torch + scipy).

What is searched, for a side (K or V) with a given :class:`~kvcal.formats.spec.TensorQuantSpec`:

* **dynamic** granularities (per-token, per-token-group, KIVI's per-channel-token-group): a
  ``clip_ratio`` per KV head (fraction of each group's range kept, see
  :func:`kvcal.formats.quant.fake_quant`) instead of raw min/max (1.0) or a hand-tuned constant
  (SKVQ's 0.91–0.97, QuaRot's 0.95);
* **static per-channel** integer keys: per-channel ``[lo, hi]`` ranges (stored as ``scale`` and
  ``zero_point`` ``[1,H,1,D]``) from two families with one scalar per KV head — the observed
  min/max shrunk about its centre by ``c`` (``"shrink"``), or ``mean ± z·std`` cut to min/max
  (``"std"``), the statistics coming from the streaming capture over every calibration token
  (sink tokens excluded);
* **non-uniform levels** (symmetric per-token / per-token-group values, ``codebook=Codebook.LEVELS``): one
  ``2^b``-entry table per layer fitted by Lloyd / k-means on the calibration
  values (:func:`fit_levels`), kept per KV head only where it beats the uniform grid on held-out;
* **trellis-coded values** (``codebook=Codebook.TRELLIS, trellis_nu=ν``, symmetric per-token int2–int4
  values, searched after the levels): one ``2^(ν+b)``-entry int8 table per layer fitted by the generalized Lloyd
  algorithm on the calibration values (:func:`fit_trellis`; :mod:`kvcal.formats.trellis`), kept for
  the layer (all KV heads share the table) only where its held-out error is below the levels plan's;
* **key centering** (dynamic keys): a per-channel mean ``[1,H,1,D]`` subtracted before quantizing
  and added back after — exact under softmax (it shifts every score of a query by ``q·μ``);
  kept per KV head only where it lowers the held-out error. Static asymmetric per-channel keys
  need none (the zero point absorbs the offset).

Procedure (per layer and side): the objective (keys: attention KL, values: attention-output
error, see :mod:`kvcal.search.objectives`) is summed over **all** calibration sequences for a
coarse grid of the scalar (all KV heads evaluated at once, heads are separable), then refined per
head with ``scipy.optimize.minimize_scalar(method="bounded")`` between the grid neighbours of the
best point (on one-head views, so a refinement step costs ``1/H_kv`` of a grid step). The winner
per head is then compared on the **held-out** split with plain min/max (clip 1, no centering) and
the lower held-out error is kept, so the result is never worse than min/max on held-out data.

Sink tokens (the first ``sinks`` tokens, kept in 16 bits by the plan) are excluded from the
quantized part exactly as :meth:`kvcal.plan.KVPlan.fake_quant` does: the search quantizes
``x[:, sinks:]`` and rounds the sinks to bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvcal.formats.granularity import PerChannel
from kvcal.formats.scales import params_from_range
from kvcal.formats.spec import TensorQuantSpec
from kvcal.formats.transforms import Transform
from kvcal.formats.variants import ChannelWidths, Codebook, QuantTables, Rounding, ScaleCoding
from kvcal.plan import SidePlan, quantize_seq
from kvcal.search.objectives import SequenceCache
from kvcal.search.presets import SideChoice
from kvcal.search.tables import (
    channel_bit_allocation,
    fit_levels,
    fit_trellis,
    log8_scale_base,
    query_rounding,
    uniform_levels,
)

OBJECTIVES = ("kl", "centered", "out", "mse")
DEFAULT_OBJECTIVE = {"k": "kl", "v": "out"}


def clip_grid(bits: int) -> tuple[float, ...]:
    """Coarse clip-ratio grid for a payload width (finer near 1 for 8 bits)."""
    if bits >= 8:
        return (1.0, 0.99, 0.98, 0.96, 0.94, 0.92, 0.9, 0.85)
    if bits >= 4:
        return (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6)
    return (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


def std_grid(bits: int) -> tuple[float, ...]:
    """Coarse grid of ``z`` for the ``mean ± z·std`` per-channel range family."""
    if bits >= 8:
        return (16.0, 12.0, 10.0, 8.0, 6.0)
    if bits >= 4:
        return (8.0, 6.0, 5.0, 4.0, 3.0, 2.5)
    return (5.0, 4.0, 3.0, 2.5, 2.0, 1.5)


# ---- evaluating one side plan ---------------------------------------------------------------------

def side_error(caches: list[SequenceCache], side: str, plan: SidePlan, objective: str | None = None,
               sinks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Objective of ``plan`` summed over ``caches``: ``(numerator [H], normalizer [H])``, float64.

    ``objective``: ``"kl"`` (keys; normalizer = evaluated queries, result in nats per query),
    ``"centered"`` (keys; per query), ``"out"`` (keys or values: relative attention-output error),
    ``"mse"`` (relative tensor MSE). Default: :data:`DEFAULT_OBJECTIVE`.
    """
    obj = objective or DEFAULT_OBJECTIVE[side]
    if obj not in OBJECTIVES or (side == "v" and obj in ("kl", "centered")):
        raise ValueError(f"objective {obj!r} is not defined for side {side!r}")
    from kvcal.kernels.attn_error import key_kl

    num = den = None
    for c in caches:
        x = c.k if side == "k" else c.v
        xh = None if obj == "kl" else quantize_seq(plan, x, sinks)
        if obj == "kl":
            e, r = key_kl(c, plan, sinks), torch.full((x.shape[0],), float(c.num_queries), dtype=torch.float64)
        elif obj == "centered":
            e, r = c.key_centered(xh), torch.full((x.shape[0],), float(c.num_queries), dtype=torch.float64)
        elif obj == "out":
            e, r = c.key_output_error(xh) if side == "k" else c.value_error(xh)
        else:
            d = xh.double() - x.double()
            e, r = (d * d).sum(dim=(1, 2)), (x.double() ** 2).sum(dim=(1, 2))
        num = e if num is None else num + e
        den = r if den is None else den + r
    return num, den.clamp_min(1e-30)


# ---- parameterized plans -------------------------------------------------------------------------

def _static_range(stats: dict, family: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(lo, hi)`` ``[1,H,1,D]`` for a family and per-head scalar ``t [H]``."""
    mn, mx = stats["min"].float(), stats["max"].float()  # [H, D]
    tt = t.float()[:, None]
    if family == "shrink":
        mid, half = (mx + mn) / 2, (mx - mn) / 2
        lo, hi = mid - tt * half, mid + tt * half
    elif family == "std":
        mu, sd = stats["mean"].float(), stats["std"].float()
        lo, hi = torch.maximum(mn, mu - tt * sd), torch.minimum(mx, mu + tt * sd)
    else:
        raise ValueError(f"unknown range family {family!r}")
    return lo[None, :, None], hi[None, :, None]


def make_plan(spec: TensorQuantSpec, t: torch.Tensor, *, family: str = "clip", stats: dict | None = None,
              mean: torch.Tensor | None = None, transform: Transform = Transform.NONE, rope=None,
              tables: QuantTables | None = None) -> SidePlan:
    """A :class:`SidePlan` for spec and per-head parameter ``t [H]``.

    ``family="clip"`` (dynamic specs): ``clip_ratio = t``; ``"shrink"`` / ``"std"`` (static
    per-channel int specs): ranges from ``stats`` (``min``/``max``/``mean``/``std`` ``[H, D]``).
    ``mean`` ``[H, D]``: key centering (rows of zeros = off for that head). ``transform`` /
    ``rope``: see :class:`~kvcal.plan.SidePlan` (dynamic specs only: the capture statistics that
    static ranges come from are of the untransformed tensor). ``tables``: the side's variant tables
    (:class:`~kvcal.formats.variants.QuantTables`): ``rounding`` ``U [H, D, D]`` for
    query-aware rounding (see :func:`~kvcal.search.tables.query_rounding`), ``channel_bits`` per-channel widths
    ``[H, D]`` (dynamic asymmetric per-channel specs; :func:`~kvcal.search.tables.channel_bit_allocation`),
    ``levels`` non-uniform levels ``[H, 2^b]`` (dynamic symmetric per-token specs;
    :func:`~kvcal.search.tables.fit_levels`), ``scale_base`` ``[H]`` base of log8 scales
    (:func:`~kvcal.search.tables.log8_scale_base`)."""
    tables, transform = QuantTables.coerce(tables), Transform.of(transform)
    m = None if mean is None else mean.float().reshape(1, *mean.shape[-2:]).unsqueeze(2)
    if family == "clip":
        if not spec.dynamic:
            raise ValueError(f"clip search needs a dynamic spec, got {spec.granularity.name}")
        return SidePlan(spec, clip_ratio=t.float().clone(), mean=m, transform=transform,
                        rope=rope if transform is Transform.PRE_ROPE else None, tables=tables)
    if tables.channel_widths is ChannelWidths.ALLOCATED or tables.codebook is Codebook.LEVELS:
        raise ValueError("per-channel bit widths and non-uniform levels are searched for dynamic specs only")
    if transform is not Transform.NONE:
        raise ValueError(f"transform {transform!r} needs a dynamic spec (static ranges come from untransformed stats)")
    if stats is None:
        raise ValueError("static per-channel ranges need capture statistics")
    lo, hi = _static_range(stats, family, t)
    if m is not None:
        lo, hi = lo - m, hi - m
    hi = torch.maximum(hi, lo + 1e-6)
    if spec.symmetric:
        scale, zp = params_from_range(spec, amax=torch.maximum(hi.abs(), lo.abs()))
    else:
        scale, zp = params_from_range(spec, amax=hi, amin=lo)
    return SidePlan(spec, scale=scale.float(), zero_point=None if zp is None else zp.float(), mean=m,
                    tables=QuantTables(rounding=tables.rounding))


@dataclass
class SideSearch:
    """Result of :func:`search_side` for one layer and side.

    ``plan``: the chosen :class:`SidePlan`; ``param`` ``[H]`` and ``family`` / ``label`` per head
    (e.g. ``"clip"``, ``"clip+center"``, ``"std"``, ``"minmax"``); ``calib`` / ``heldout``:
    normalized objective of the chosen plan (and ``heldout_minmax`` for plain min/max);
    ``heldout_out``: held-out relative attention-output error (the unit bit allocation uses);
    ``evaluations``: objective evaluations spent (one = all calibration sequences, all heads)."""

    spec: TensorQuantSpec
    plan: SidePlan
    param: torch.Tensor
    label: list[str]
    calib: float
    heldout: float
    heldout_minmax: float
    heldout_out: float = float("nan")
    evaluations: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_meta(self) -> dict:
        return {"spec": self.spec.to_dict(), "param": [round(float(x), 5) for x in self.param],
                "label": self.label, "calib": self.calib, "heldout": self.heldout,
                "heldout_minmax": self.heldout_minmax, "heldout_out": self.heldout_out,
                "transform": self.plan.transform.value, "rounding": self.plan.rounding_mode is Rounding.QUERY_AWARE,
                **({} if self.plan.channel_widths is ChannelWidths.SPEC else
                   {"channel_bits": torch.bincount(self.plan.channel_bits.flatten(), minlength=9)[1:].tolist()}),
                **({} if self.plan.codebook is not Codebook.LEVELS else
                   {"levels": [[round(float(x), 4) for x in row] for row in self.plan.levels]}),
                **({} if self.plan.codebook is not Codebook.TRELLIS else
                   {"trellis": {"entries": int(self.plan.trellis.numel()),
                                "nu": int(self.plan.trellis.numel()).bit_length() - 1 - self.spec.bits}}),
                **({k: v for k, v in self.extra.items() if k.startswith("trellis_")})}


def _refine(caches, side, objective, sinks, build, lo_b, hi_b, x0, f0, H, evals):
    """Per-head bounded scalar refinement; returns improved ``(x [H], f [H])``."""
    from scipy.optimize import minimize_scalar

    x, f = x0.clone(), f0.clone()
    for h in range(H):
        views = [c.head(h) for c in caches]
        if float(hi_b[h] - lo_b[h]) < 1e-4:
            continue

        def fun(t, h=h, views=views):
            evals[0] += 1.0 / H
            n, d = side_error(views, side, build(h, t), objective, sinks)
            return float(n[0] / d[0])

        r = minimize_scalar(fun, bounds=(float(lo_b[h]), float(hi_b[h])), method="bounded",
                            options={"xatol": 2e-3, "maxiter": 8})
        if r.fun < float(f[h]):
            x[h], f[h] = float(r.x), float(r.fun)
    return x, f


def _one_head(spec, family, stats, mean, h, t, H, quant_kw: dict | None = None):
    """Plan for the one-head view ``h`` with parameter ``t`` (``quant_kw``: transform / rope /
    rounding for :func:`make_plan`, the rounding matrix sliced to head ``h``)."""
    st = None if stats is None else {k: v[h : h + 1] for k, v in stats.items() if k in ("min", "max", "mean", "std")}
    mh = None if mean is None else mean[h : h + 1]
    kw = dict(quant_kw or {})
    tab = kw.get("tables")
    if tab is not None:  # per-head tables sliced to head h (a trellis table is per layer: none here)
        kw["tables"] = tab.replace(**{n: v[h : h + 1] for n, v in tab.as_kwargs().items()
                                      if n in ("rounding", "channel_bits", "levels", "scale_base")})
    return make_plan(spec, torch.tensor([t]), family=family, stats=st, mean=mh, **kw)


def _grid_search(caches, side, spec, family, grid, stats, mean, objective, sinks, refine, evals,
                 quant_kw: dict | None = None):
    """Coarse grid for all heads, then per-head bounded refinement. Returns ``(x [H], f [H])``."""
    H = (caches[0].k if side == "k" else caches[0].v).shape[0]
    errs = []
    for g in grid:
        n, d = side_error(caches, side, make_plan(spec, torch.full((H,), g), family=family, stats=stats, mean=mean,
                                                  **(quant_kw or {})), objective, sinks)
        evals[0] += 1
        errs.append(n / d)
    E = torch.stack(errs)  # [C, H]
    best = E.argmin(0)
    g = torch.tensor(grid, dtype=torch.float64)
    x, f = g[best], E.gather(0, best[None])[0]
    if not refine:
        return x, f
    # bracket between the grid neighbours (grid is monotone)
    lo_b = g[(best + 1).clamp(max=len(grid) - 1)]
    hi_b = g[(best - 1).clamp(min=0)]
    lo_b, hi_b = torch.minimum(lo_b, hi_b), torch.maximum(lo_b, hi_b)

    def build(h, t):
        return _one_head(spec, family, stats, mean, h, t, H, quant_kw)

    return _refine(caches, side, objective, sinks, build, lo_b, hi_b, x, f, H, evals)


class _Candidate(NamedTuple):
    """One searched family of :func:`search_side`: its ``label``, range ``family`` (``None`` once static
    families are merged per head), centering ``mean`` ``[H, D]`` or ``None``, and per-head best parameter
    ``x [H]`` with its calibration error ``f [H]``."""

    label: str
    family: str | None
    mean: torch.Tensor | None
    x: torch.Tensor
    f: torch.Tensor

    @property
    def centered(self) -> bool:
        """Whether this family stores keys minus the per-channel mean."""
        return self.mean is not None


def search_side(
    calib: list[SequenceCache],
    heldout: list[SequenceCache],
    side: str,
    choice: SideChoice,
    *,
    stats: dict | None = None,
    sinks: int = 0,
    objective: str | None = None,
    centering: str = "auto",
    refine: bool = True,
    rope=None,
    grid: tuple[float, ...] | None = None,
) -> SideSearch:
    """Choose the parameters of one layer's K (``side='k'``) or V (``'v'``) for an integer side choice.

    ``choice``: a :class:`~kvcal.search.presets.SideChoice` — the int spec and its variants (transform,
    rounding, clip search, channel widths, codebook), checked when it was built and against ``side``
    here (:meth:`~kvcal.search.presets.SideChoice.check_side`); anything else is a ``ValueError``.

    ``calib`` / ``heldout``: per-sequence caches of this layer (held-out may be empty: then the
    calibration split is reused and the guard is only a calibration-split check). ``stats``:
    :meth:`~kvcal.capture.stats.TensorStats.finalize` of this layer's side (``min``, ``max``,
    ``mean``, ``std`` ``[H, D]``; sinks excluded), needed for static per-channel specs and
    centering. ``centering``: ``"auto"`` (keys, dynamic specs: kept per head where it helps on
    held-out), ``"off"``, or ``"on"``. Raises ``ValueError`` for a spec this search does not
    handle (16-bit, FP8 — see :mod:`kvcal.search.static_scales` —, NVFP4, static per-tensor/head
    ints). ``choice.transform`` / ``rope``: quantize after a transform (:mod:`kvcal.formats.transforms`;
    dynamic specs only; centering is then off); the guard's min/max baseline uses the same
    transform, and the objective is always measured on what attention reads (post-RoPE).
    ``grid``: clip-ratio grid of dynamic specs (default :func:`clip_grid`, or ``(1.0,)`` = plain
    min/max ranges, no search, when ``choice.clip_search`` is ``False``). Query-aware rounding (keys,
    int): :func:`query_rounding` of the calibration split; heads whose held-out winner is plain
    min/max get the identity (nearest rounding). Allocated channel widths (keys, dynamic asymmetric
    per-channel int): per-channel widths from :func:`channel_bit_allocation` in every candidate; heads
    whose held-out winner is plain min/max get uniform widths. Levels codebook (values, dynamic
    symmetric per-token / per-token-group int2–int6): every candidate uses the :func:`fit_levels`
    table of the calibration split; the min/max baseline is the uniform grid as a table
    (:func:`uniform_levels`), which heads whose held-out winner is min/max keep. Trellis codebook
    (symmetric per-token int2–int4 values): after the levels search, a :func:`fit_trellis` table
    (``2^choice.trellis_nu`` states) of the calibration split replaces the levels for the whole layer
    when the trellis plan's held-out error is lower (``extra`` records both held-out errors; the
    guard against min/max still holds).
    """
    if not isinstance(choice, SideChoice):
        raise ValueError(f"search_side needs a SideChoice (kvcal.search.presets), got {type(choice).__name__}")
    choice.check_side(side)
    if not choice.clip_search:
        if grid is not None and tuple(grid) != (1.0,):
            raise ValueError(f"grid={grid} searches clip ratios but the choice has clip_search=False")
        grid = (1.0,)
    spec, transform = choice.spec, choice.transform
    rounding = choice.rounding is Rounding.QUERY_AWARE
    channel_bits = choice.channel_widths is ChannelWidths.ALLOCATED
    levels = choice.codebook is not Codebook.UNIFORM  # a trellis choice searches levels first
    trellis_nu = choice.trellis_nu if choice.codebook is Codebook.TRELLIS else 0
    log8 = choice.scale_coding is ScaleCoding.LOG8
    if (rounding or channel_bits or levels or log8) and not calib:
        raise ValueError("no calibration sequences to search on")
    U = query_rounding(calib, transform, rope) if rounding else None
    W = channel_bit_allocation(calib, spec, transform, rope, sinks) if channel_bits else None
    base = log8_scale_base(calib, side, spec, transform, rope, sinks, levels) if log8 else None
    Lv = fit_levels(calib, spec, transform, sinks, scale_base=base) if levels else None
    L0 = None if Lv is None else uniform_levels(spec.bits)[None].expand_as(Lv).contiguous()
    quant_kw = {"transform": transform, "rope": rope,
                "tables": QuantTables(rounding=U, channel_bits=W, levels=Lv, scale_base=base)}
    if transform is not Transform.NONE or rounding or channel_bits:
        centering = "off"
    if spec.format.kind != "int":
        raise ValueError(f"search_side handles integer specs; {spec.format.value} is searched elsewhere")
    if not spec.dynamic and not isinstance(spec.granularity, PerChannel):
        raise ValueError(f"static int search supports per-channel ranges, not {spec.granularity.name}")
    if not calib:
        raise ValueError("no calibration sequences to search on")
    held = heldout or calib
    H = (calib[0].k if side == "k" else calib[0].v).shape[0]
    evals = [0.0]
    families: list[tuple[str, str, torch.Tensor | None]] = []  # (label, family, mean)
    if spec.dynamic:
        families.append(("clip", "clip", None))
        if side == "k" and centering != "off" and stats is not None:
            families.append(("clip+center", "clip", stats["mean"].float()))
        if centering == "on" and len(families) == 2:
            families = families[1:]
    else:
        if stats is None:
            raise ValueError("static per-channel search needs capture statistics (stats=)")
        families += [("shrink", "shrink", None), ("std", "std", None)]
    results: list[_Candidate] = []
    for label, family, mean in families:
        g_ = (grid or clip_grid(spec.bits)) if family in ("clip", "shrink") else std_grid(spec.bits)
        x, f = _grid_search(calib, side, spec, family, g_, stats, mean, objective, sinks, refine and len(g_) > 1,
                            evals, quant_kw)
        results.append(_Candidate(label, family, mean, x, f))
    if not spec.dynamic:  # static families compete on calibration error per head
        r0, r1 = results
        pick1 = r1.f < r0.f
        results = [_Candidate("per-head", None, None, torch.where(pick1, r1.x, r0.x), torch.where(pick1, r1.f, r0.f))]
        fams = [r1.family if b else r0.family for b in pick1.tolist()]
    # held-out: each variant and plain min/max, per head
    base_family = "clip" if spec.dynamic else "shrink"
    base_plan = make_plan(spec, torch.ones(H), family=base_family, stats=stats, transform=transform, rope=rope,
                          tables=QuantTables(levels=L0, scale_base=base))
    nb, db = side_error(held, side, base_plan, objective, sinks)
    evals[0] += len(held) / max(len(calib), 1)
    best_err, best_idx = nb / db, torch.full((H,), -1)
    plans = []
    for i, cand in enumerate(results):
        if spec.dynamic:
            p = make_plan(spec, cand.x, family="clip", mean=cand.mean, **quant_kw)
        else:
            p = _static_plan_mixed(spec, stats, cand.x, fams)
        plans.append(p)
        n, d = side_error(held, side, p, objective, sinks)
        evals[0] += len(held) / max(len(calib), 1)
        e = n / d
        better = e < best_err
        best_err, best_idx = torch.where(better, e, best_err), torch.where(better, torch.full((H,), i), best_idx)
    # assemble the per-head choice
    param = torch.ones(H, dtype=torch.float64)
    labels, calib_f = [], torch.zeros(H, dtype=torch.float64)
    mean_rows = torch.zeros(H, stats["mean"].shape[-1]) if stats is not None else None
    any_mean = False
    fam_final = []
    for h in range(H):
        i = int(best_idx[h])
        if i < 0:
            labels.append("minmax")
            fam_final.append(base_family)
            calib_f[h] = float("nan")
            continue
        cand = results[i]
        param[h], calib_f[h] = cand.x[h], cand.f[h]
        if spec.dynamic:
            labels.append(cand.label)
            fam_final.append("clip")
            if cand.centered:
                mean_rows[h] = cand.mean[h]
                any_mean = True
        else:
            labels.append(fams[h])
            fam_final.append(fams[h])
    U_final = None
    if U is not None:
        eye = torch.eye(U.shape[-1])
        U_final = torch.stack([U[h] if int(best_idx[h]) >= 0 else eye for h in range(H)])
    W_final = None
    if W is not None:
        W_final = torch.stack([W[h] if int(best_idx[h]) >= 0 else torch.full_like(W[h], spec.bits) for h in range(H)])
    L_final = None
    if Lv is not None:
        L_final = torch.stack([Lv[h] if int(best_idx[h]) >= 0 else L0[h] for h in range(H)])
    if spec.dynamic:
        plan = make_plan(spec, param, family="clip", mean=mean_rows if any_mean else None, transform=transform,
                         rope=rope, tables=QuantTables(rounding=U_final, channel_bits=W_final, levels=L_final,
                                                       scale_base=base))
    else:
        plan = _static_plan_mixed(spec, stats, param, fam_final)
    # final figures (normalized over heads)
    n, d = side_error(held, side, plan, objective, sinks)
    extra = {"centered_heads": [h for h in range(H) if labels[h].endswith("center")]}
    if trellis_nu:  # the levels plan's held-out error against a trellis table's, for the whole layer
        T = fit_trellis(calib, spec, trellis_nu, transform, sinks, scale_base=base)
        tplan = SidePlan(spec, transform=transform, tables=QuantTables(scale_base=base, trellis=T))
        tn, td = side_error(held, side, tplan, objective, sinks)
        evals[0] += len(held) / max(len(calib), 1)
        extra.update(trellis_heldout=float(tn.sum() / td.sum()), trellis_levels_heldout=float(n.sum() / d.sum()))
        if float(tn.sum() / td.sum()) < float(n.sum() / d.sum()):
            plan, n, d = tplan, tn, td
            labels, param = ["trellis"] * H, torch.ones(H, dtype=torch.float64)
    no, do = side_error(held, side, plan, "out", sinks) if (objective or DEFAULT_OBJECTIVE[side]) != "out" else (n, d)
    nc, dc = side_error(calib, side, plan, objective, sinks)
    evals[0] += 1 + 2 * len(held) / max(len(calib), 1)
    assert float(n.sum() / d.sum()) <= float(nb.sum() / db.sum()) * (1 + 1e-6) + 1e-12
    return SideSearch(spec, plan, param.float(), labels, float(nc.sum() / dc.sum()), float(n.sum() / d.sum()),
                      float(nb.sum() / db.sum()), float(no.sum() / do.sum()), evals[0], extra)


def _static_plan_mixed(spec, stats, x: torch.Tensor, families: list[str]) -> SidePlan:
    """Static per-channel plan whose head ``h`` uses ``families[h]`` with parameter ``x[h]``."""
    H = x.numel()
    scales, zps = [], []
    for h in range(H):
        st = {k: v[h : h + 1] for k, v in stats.items() if k in ("min", "max", "mean", "std")}
        p = make_plan(spec, x[h : h + 1], family=families[h], stats=st)
        scales.append(p.scale)
        zps.append(p.zero_point)
    zp = None if zps[0] is None else torch.cat(zps, dim=1)
    return SidePlan(spec, scale=torch.cat(scales, dim=1), zero_point=zp)


__all__ = ["search_side", "side_error", "make_plan", "SideSearch", "clip_grid", "std_grid", "OBJECTIVES",
           "DEFAULT_OBJECTIVE"]

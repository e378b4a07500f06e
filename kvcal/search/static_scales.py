"""Static FP8 scale search, separately for keys and values (torch only).

For each layer and side, candidates are (per KV head for ``PerHead``, shared for ``PerTensor``):

* ``absmax``: ``amax / fmt.max`` — llm-compressor's default min/max rule;
* ``clip{r}``: ``r · amax / fmt.max`` for clip ratios ``r < 1`` (values above ``r·amax`` saturate);
* ``headroom{m}``: ``m · amax / fmt.max`` for ``m > 1`` (fewer saturations, more subnormals);
* ``unity``: scale 1.0 — what engines use without scales, ModelOpt's default;
* ``otf``: vLLM's on-the-fly rule, ``amax/200`` for keys and ``amax/100`` for values
  (vLLM ``calculate_kv_scales``).

Each candidate is scored on the calibration split with the attention-visible objective
(keys: attention KL; values: relative attention-output error, see :mod:`kvcal.search.objectives`),
errors summed over all calibration sequences. The best one is then compared on the held-out split
with ``absmax`` and ``unity`` and the lowest held-out error wins, so the exported choice is never
worse than either on held-out data. All three held-out figures are returned for the artifact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcal.formats.fp8 import FP8Format, fake_quant_fp8
from kvcal.search.objectives import SequenceCache

#: FP8 clip ratios tried. Below 0.8 nothing was ever chosen on the embedded model (FP8's relative
#: error is nearly scale-free, so clipping only adds saturation), and each ratio costs one
#: objective evaluation per layer and side.
DEFAULT_CLIP_RATIOS = (0.95, 0.9, 0.8)
DEFAULT_HEADROOM = (1.25, 1.5, 2.0, 4.0)
OTF_RANGE = {"k": 200.0, "v": 100.0}


@dataclass
class ScaleChoice:
    """The static scale chosen for one layer and side (what a static search returns; what an integer search is
    asked to store is a :class:`kvcal.search.presets.SideChoice`). ``scale`` float32 ``[1]`` or ``[H_kv]``; errors are the
    normalized objective (keys: mean KL per query, nats; values: relative output error
    ``Σ‖PΔV‖²/Σ‖PV‖²``) for the chosen / absmax / unity scales on held-out and calibration data."""

    scale: torch.Tensor
    label: list[str]
    clip_ratio: torch.Tensor  # chosen scale · fmax / amax, [1] or [H_kv]
    heldout: dict[str, float]
    calib: dict[str, float]
    amax: torch.Tensor
    #: the clip-free choice (:func:`clip_free_of`): ``{"scale": float32 [1]/[H_kv], "label": [...], "heldout":
    #: float, "calib": float}`` (errors normalized as ``heldout``/``calib``) — what a non-saturating engine
    #: (SGLang) is exported; the chosen scale itself where it clips nothing. ``None``: not searched.
    clip_free: dict | None = field(default=None)
    #: per-tensor searches: every candidate's calibration-split error, ``{"label": [...], "scale": [...],
    #: "calib": [...]}`` (normalized as ``calib``), from which export prices a scale changed after the search
    #: (``--headroom``: :func:`kvcal.export.base.headroom_cost`). ``None`` for per-head scales.
    candidates: dict | None = field(default=None)


def candidates_record(labels: list[str], scales: torch.Tensor, num_c: torch.Tensor, norm_c: float) -> dict:
    """:attr:`ScaleChoice.candidates` of a per-tensor search: ``scales`` ``[C, H]`` (equal columns), ``num_c``
    ``[C, H]`` summed calibration errors, ``norm_c`` the normalizer of the choice's ``calib`` figures."""
    return {"label": list(labels), "scale": [float(x) for x in scales[:, 0].float()],
            "calib": [float(x) / norm_c for x in num_c.sum(1)]}


def clips(scale: torch.Tensor, amax: torch.Tensor, fmt_max: float) -> bool:
    """Whether a static scale (``[1]`` or ``[H]``) saturates values the calibration observed: some
    ``scale x fmt_max < amax`` (``amax`` shaped like ``scale``; relative tolerance 1e-6)."""
    return bool((scale.double() * fmt_max < amax.double() * (1 - 1e-6)).any())


def clip_free_of(choice: ScaleChoice, labels: list[str], scales: torch.Tensor, amax_cols: torch.Tensor,
                 fmt_max: float, errors, calib, heldout, num_c: torch.Tensor, per_head: bool,
                 norm_c: float, norm_h: float) -> dict:
    """The ``clip_free`` record of a :class:`ScaleChoice`: the choice itself where it clips nothing, else the
    search repeated over the clip-free candidates (:func:`kvcal.search.guard.clip_free_choice`). ``scales``
    ``[C, H]``, ``amax_cols`` ``[H]``, ``num_c`` ``[C, H]`` the calibration errors the search computed;
    ``norm_c``/``norm_h``: the normalizers of the choice's own figures (figure = column-summed error / norm)."""
    from kvcal.search.guard import clip_free_choice

    if not clips(choice.scale, choice.amax, fmt_max):
        return {"scale": choice.scale.clone(), "label": list(choice.label), "heldout": choice.heldout["chosen"],
                "calib": choice.calib["chosen"]}
    pick = clip_free_choice(errors, calib, heldout, scales, amax_cols, fmt_max, num_c, per_head)
    idx = pick.index if per_head else pick.index[:1]
    return {"scale": pick.scale if per_head else pick.scale[:1], "label": [labels[i] for i in idx.tolist()],
            "heldout": pick.heldout / norm_h, "calib": pick.calib / norm_c}


def candidate_scales(amax: torch.Tensor, fmt: FP8Format, side: str,
                     clip_ratios=DEFAULT_CLIP_RATIOS, headroom=DEFAULT_HEADROOM) -> tuple[list[str], torch.Tensor]:
    """Labels and candidate scales ``[C, H]`` (float32) for per-head ``amax`` ``[H]``.
    Index 0 is ``absmax`` and index 1 is ``unity`` (the two baselines)."""
    amax = amax.float().clamp_min(torch.finfo(torch.float32).tiny)
    base = amax / fmt.max
    labels = ["absmax", "unity", "otf"]
    rows = [base, torch.ones_like(base), amax / OTF_RANGE[side]]
    for r in clip_ratios:
        labels.append(f"clip{r:g}")
        rows.append(base * r)
    for m in headroom:
        labels.append(f"headroom{m:g}")
        rows.append(base * m)
    return labels, torch.stack(rows)


def _side_errors(caches: list[SequenceCache], side: str, scales: torch.Tensor, fmt: FP8Format, fake_quant=None):
    """Summed errors ``[C, H]`` (numerator) and normalizer ``[H]`` over sequences. ``fake_quant(x, scale)``
    (``x`` [H, T, D], ``scale`` [H, 1, 1]): the write path scored (default: ``fmt`` rounded to nearest)."""
    C, H = scales.shape
    num = torch.zeros(C, H, dtype=torch.float64)
    den = torch.zeros(H, dtype=torch.float64)
    for c in caches:
        x = c.k if side == "k" else c.v
        if side == "k":
            den += c.num_queries
        for i in range(C):
            xh = (fake_quant_fp8(x, scales[i].view(H, 1, 1), fmt) if fake_quant is None
                  else fake_quant(x, scales[i].view(H, 1, 1)))
            if side == "k":
                num[i] += c.key_kl(xh)
            else:
                e, ref = c.value_error(xh)
                num[i] += e
                if i == 0:
                    den += ref
    return num, den.clamp_min(1e-30)


def choose_static_fp8(
    calib: list[SequenceCache],
    heldout: list[SequenceCache],
    amax_head: torch.Tensor,
    side: str,
    fmt: FP8Format,
    per_head: bool,
    fake_quant=None,
) -> ScaleChoice:
    """Choose the static FP8 scale of one layer's keys (``side='k'``) or values (``'v'``).

    ``amax_head`` ``[H_kv]``: observed absmax per KV head on the calibration split.
    ``per_head``: one scale per KV head (``[H_kv]``), else one per tensor (``[1]``).
    ``fake_quant``: the engine's write path, as :func:`_side_errors` takes it (default: ``fmt`` rounded
    to nearest).
    """
    H = amax_head.numel()
    amax = amax_head.double() if per_head else amax_head.double().max().expand(H)
    labels, scales = candidate_scales(amax, fmt, side)
    num_c, den_c = _side_errors(calib, side, scales, fmt, fake_quant)
    held = heldout if heldout else calib
    if per_head:
        best = num_c.argmin(0)  # [H]
        cand = torch.stack([best, torch.zeros(H, dtype=torch.long), torch.ones(H, dtype=torch.long)])  # [3, H]
        cand_scales = scales.gather(0, cand)  # [3, H]
        num_h, den_h = _side_errors(held, side, cand_scales, fmt, fake_quant)
        pick = num_h.argmin(0)  # first of ties: calib-best preferred
        final_idx = cand.gather(0, pick[None])[0]
        scale = scales.gather(0, final_idx[None])[0]
        chosen_h = num_h.gather(0, pick[None])[0].sum()
        heldout_fig = {"chosen": float(chosen_h / den_h.sum()), "absmax": float(num_h[1].sum() / den_h.sum()),
                       "unity": float(num_h[2].sum() / den_h.sum())}
        calib_fig = {"chosen": float(num_c.gather(0, final_idx[None])[0].sum() / den_c.sum()),
                     "absmax": float(num_c[0].sum() / den_c.sum()), "unity": float(num_c[1].sum() / den_c.sum())}
        lab = [labels[i] for i in final_idx.tolist()]
        amax_out = amax_head.float()
    else:
        tot_c = num_c.sum(1)
        best = int(tot_c.argmin())
        cand = [best, 0, 1]
        num_h, den_h = _side_errors(held, side, scales[cand], fmt, fake_quant)
        tot_h = num_h.sum(1)
        pick = int(tot_h.argmin())
        final = cand[pick]
        scale = scales[final, :1]
        heldout_fig = {"chosen": float(tot_h[pick] / den_h.sum()), "absmax": float(tot_h[1] / den_h.sum()),
                       "unity": float(tot_h[2] / den_h.sum())}
        calib_fig = {"chosen": float(tot_c[final] / den_c.sum()), "absmax": float(tot_c[0] / den_c.sum()),
                     "unity": float(tot_c[1] / den_c.sum())}
        lab = [labels[final]]
        amax_out = amax[:1].float()
    clip = (scale.double() * fmt.max / amax_out.double()).float()
    choice = ScaleChoice(scale=scale.float(), label=lab, clip_ratio=clip, heldout=heldout_fig,
                         calib=calib_fig, amax=amax_out)
    choice.clip_free = clip_free_of(choice, labels, scales, amax.float(), fmt.max,
                                    lambda caches, rows: _side_errors(caches, side, rows, fmt, fake_quant)[0],
                                    calib, heldout, num_c, per_head, float(den_c.sum()), float(den_h.sum()))
    if not per_head:
        choice.candidates = candidates_record(labels, scales, num_c, float(den_c.sum()))
    return choice

"""How much could better coding still buy an integer plan? A rate-distortion probe (issue 4).

For a calibrated integer artifact (e.g. ``kvcal calibrate --preset int4``) the keys and values that
attention reads are replaced, at the plan's own layout and payload, by an **ideal Gaussian coder**:
the backward test channel of the Gaussian rate-distortion function (Cover & Thomas, *Elements of
Information Theory*, 2nd ed., Thm. 10.3.2 and §10.3.3). An element ``x`` of a group with mean ``μ``
and variance ``σ²`` coded at ``R`` bits becomes

    x̂ = μ + (1 − ε)·(x − μ) + sqrt(ε·(1 − ε))·σ·n,   ε = 2^(−2R),   n ~ N(0, 1) (seeded)

so that ``E[(x − x̂)²] = ε·σ²`` for *any* distribution of ``x`` with that variance. By Shannon's
bound, ``σ²·2^(−2R)`` is achievable for every source of variance ``σ²`` and is the minimum for an
i.i.d. Gaussian one (Gaussian is the hardest source to compress); no per-element or per-row coder
that ignores the dependence between elements can do better on Gaussian-like data. The groups and
rates are the plan's (side information as the plan stores it):

* values (per-token rows after the plan's transform, symmetric): ``μ = 0``, ``σ² = mean(x²)`` of
  the row, ``R`` = the layer's value bits;
* keys (per-channel groups of ``group_size`` tokens after the transform, asymmetric): ``μ`` and
  ``σ²`` of each (channel, group), ``R`` = that channel's width (``channel_bits``) or the spec's bits.

Sink tokens stay as the plan keeps them. Prints Protocol A (:func:`kvcal.evaluate.teacher_forced`)
on ``--windows`` 1024-token windows of ``wikitext2_valid.txt`` for the artifact's own quantizer and
for the ideal coder at the same rates — all sides, K only, V only — and the per-layer relative MSE of
both on the first window. The gap between the two rows is the most that any better coder of
independent elements could still recover at this layout and bit budget.

    HF_HUB_OFFLINE=1 .venv/bin/kvcal calibrate --corpus calibration_sets/chat.jsonl --preset int4 \\
        --out bench_out/int4
    HF_HUB_OFFLINE=1 .venv/bin/python diagnostics/probe_bound.py --artifact bench_out/int4 --windows 8  # ~12 min

Writes nothing. Diagnostics of one plan on the benchmark's evaluation windows, not a tuning split.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "wikitext2_valid.txt"


def gaussian_channel(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, bits: torch.Tensor,
                     gen: torch.Generator, gap_db: float = 0.0) -> torch.Tensor:
    """Backward Gaussian test channel at ``bits`` per element (float32; arguments broadcast to ``x``),
    its distortion ``gap_db`` above ``σ²·2^(−2R)`` (0: the bound itself)."""
    eps = (torch.exp2(-2.0 * bits.float()) * 10 ** (gap_db / 10)).clamp(max=1.0)
    n = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    return mean + (1 - eps) * (x - mean) + (eps * (1 - eps) * var).clamp_min(0).sqrt() * n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="integer kvcal artifact directory")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gaps", default="0.5,1,1.5,2",
                    help="also score coders this many dB above the bound on every key and value (comma-separated)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)

    from _probe import load_probe, print_protocol_a

    from kvcal.capture.hooks import capture_kv
    from kvcal.evaluate.protocol_a import side_only, teacher_forced
    from kvcal.evaluate.windows import text_windows
    from kvcal.formats.transforms import apply_transform

    def check(plan):
        for i, lp in enumerate(plan.layers):
            k, v = lp.k.spec, lp.v.spec
            if (k.format.kind != "int" or v.format.kind != "int" or k.granularity.name != "channel_token_group"
                    or v.granularity.name != "token"):
                raise SystemExit(f"{a.artifact}: layer {i}: the probe needs integer keys in per-channel token groups "
                                 f"and integer per-token values (the int4 / int2 / --bits layouts), got "
                                 f"{k.format.value} {k.granularity.name} / {v.format.value} {v.granularity.name}")

    _, plan, tok, model = load_probe(a.artifact, check=check)
    sinks = plan.sink_tokens

    def ideal(i: int, side: str, x: torch.Tensor, start: int, gen: torch.Generator, gap: float) -> torch.Tensor:
        sp = plan.layers[i].side(side)
        y = apply_transform(sp.transform, x, rope=sp.rope, start=start)  # [B,H,S,D] float32
        if side == "v":
            out = gaussian_channel(y, torch.zeros(()), y.pow(2).mean(-1, keepdim=True),
                                   torch.tensor(float(sp.spec.bits)), gen, gap)
        else:
            B, H, S, D = y.shape
            G = sp.spec.granularity.group_size
            w = (torch.full((H, D), sp.spec.bits) if sp.channel_bits is None else sp.channel_bits).float()
            out = torch.empty_like(y)
            for g0 in range(0, S, G):
                blk = y[:, :, g0:g0 + G]
                mu = blk.mean(2, keepdim=True)
                var = blk.var(2, unbiased=False, keepdim=True)
                out[:, :, g0:g0 + G] = gaussian_channel(blk, mu, var, w[None, :, None, :], gen, gap)
        if sp.transform != "none":
            out = apply_transform(sp.transform, out, rope=sp.rope, start=start, inverse=True)
        return out.to(x.dtype)

    class Ideal:
        """Ideal Gaussian coder at the plan's layout and rates; seeded per call for repeatability."""

        def __init__(self, gap: float = 0.0):
            self.calls, self.gap = 0, gap

        def fake_quant(self, i, side, x):
            self.calls += 1
            gen = torch.Generator().manual_seed(a.seed * 1_000_003 + self.calls)
            n = min(sinks, x.shape[2])
            return torch.cat([x[:, :, :n].to(torch.bfloat16).to(x.dtype), ideal(i, side, x[:, :, n:], n, gen, self.gap)], 2)

    gaps = [float(g) for g in a.gaps.split(",") if g.strip()]
    windows = text_windows(tok, DATA.read_text(encoding="utf-8"), 1024, a.windows)
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with capture_kv(model, lambda i, q, k, v, m: first.setdefault(i, (k.float(), v.float()))), torch.no_grad():
        model(windows[:1])
    probe = Ideal()
    print(f"\nartifact {a.artifact}: {plan.num_layers} layers, {sinks} sinks; relative MSE on window 0 "
          "(ideal = sigma^2 2^(-2R) by construction, measured)\n")
    print("| layer | K bits | K plan | K ideal | gap (dB) | V bits | V plan | V ideal | gap (dB) |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for i in sorted(first):
        cells = []
        for side, x in zip("kv", first[i], strict=True):
            sp = plan.layers[i].side(side)
            xs = x[:, :, sinks:]
            e_plan = float((sp.fake_quant(xs, start=sinks) - xs).pow(2).sum() / xs.pow(2).sum())
            e_ideal = float((probe.fake_quant(i, side, x)[:, :, sinks:] - xs).pow(2).sum() / xs.pow(2).sum())
            cells += [str(sp.spec.bits), f"{e_plan:.2e}", f"{e_ideal:.2e}", f"{10 * math.log10(e_plan / e_ideal):+.2f}"]
        print(f"| {i} | " + " | ".join(cells) + " |")
    res = teacher_forced(model, windows, {
        "plan, all": plan, "plan, K only": side_only(plan, "k"), "plan, V only": side_only(plan, "v"),
        "ideal, all": Ideal(), "ideal, K only": side_only(Ideal(), "k"), "ideal, V only": side_only(Ideal(), "v"),
        **{f"ideal + {g:g} dB, all": Ideal(g) for g in gaps}})
    print_protocol_a(res, a.windows, DATA.name, "coder", top1=True)


if __name__ == "__main__":
    main()

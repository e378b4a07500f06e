"""Would trellis-coded values (:mod:`kvcal.formats.trellis`) close issue 4's int4 gap? A probe on the embedded model.

For a calibrated artifact whose values are ``b``-bit Hadamard-rotated per-token rows on a fitted
level table with log8 scales (the ``int4`` and ``int2`` presets), the values are re-coded with a
bitshift trellis at the same payload (``b`` bits per element, ``--nu`` state bits): each rotated row
is divided by its RMS rounded up to a ``2^(1/16)`` step (the log8 scale grid), Viterbi-encoded
against a per-layer table of ``2^(ν+b)`` entries fitted by Lloyd on the artifact's own calibration
corpus (all its samples, sinks excluded), and the table is stored as int8 in units of 1/32 (1 KiB per
layer at ``b = 4``, ν = 6: +0.005 bit on average at 4096 tokens, which the int4 preset's 4.2418 bits
can afford under 4.25). Keys stay as the artifact has them. Every layer's values must share one width
(the presets; a ``--bits`` artifact with mixed value widths is refused).

Prints (1) the per-element relative MSE of the artifact's value quantizer and of the trellis on the
first evaluation window, per layer, and (2) Protocol A (:func:`kvcal.evaluate.teacher_forced`) on
``--windows`` 1024-token windows of ``wikitext2_valid.txt``: mean KL (nats) and ΔPPL, all sides /
values only, levels vs trellis — a paired comparison (same keys, sinks, windows; only the values differ).

    HF_HUB_OFFLINE=1 .venv/bin/kvcal calibrate --corpus calibration_sets/chat.jsonl --preset int4 \\
        --out bench_out/int4
    HF_HUB_OFFLINE=1 .venv/bin/python diagnostics/probe_trellis.py --artifact bench_out/int4   # ~15 min here

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
UNIT = 32  # int8 table codes per unit of the row's scale


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="int4- or int2-preset kvcal artifact directory")
    ap.add_argument("--nu", type=int, default=6, help="trellis state bits (table 2^(nu+b) entries)")
    ap.add_argument("--iters", type=int, default=16, help="Lloyd rounds of the table fit")
    ap.add_argument("--fit-rows", type=int, default=6000, help="value rows per layer the table is fitted on")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    from _probe import load_probe, print_protocol_a
    from tqdm.auto import tqdm

    from kvcal.capture.hooks import capture_kv
    from kvcal.corpus import load_corpus
    from kvcal.evaluate.protocol_a import side_only, teacher_forced
    from kvcal.evaluate.windows import text_windows
    from kvcal.formats import trellis
    from kvcal.formats.transforms import apply_transform

    def check(plan):
        bits = plan.layers[0].v.spec.bits
        for i, lp in enumerate(plan.layers):
            v = lp.v
            if (v.spec.format.kind != "int" or v.spec.bits != bits or v.transform != "hadamard" or v.levels is None
                    or v.spec.granularity.name != "token"):
                raise SystemExit(f"{a.artifact}: layer {i}: the probe needs {bits}-bit Hadamard per-token values with "
                                 f"levels in every layer (the int4 / int2 presets), got {v.spec.format.value} "
                                 f"{v.spec.granularity.name} / {v.transform} / levels "
                                 f"{'yes' if v.levels is not None else 'no'}")

    art, plan, tok, model = load_probe(a.artifact, check=check)
    bits = plan.layers[0].v.spec.bits
    sinks = plan.sink_tokens
    corpus = load_corpus(REPO / art.metadata["corpus"]["path"], tok, max_seq_len=1024)

    def rotated_rows(x: torch.Tensor) -> torch.Tensor:  # [1,H,S,D] -> [H*S, D]
        return apply_transform("hadamard", x.float()).reshape(-1, x.shape[-1])

    def scale(rows: torch.Tensor) -> torch.Tensor:  # RMS rounded up to the log8 grid
        r = rows.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
        return torch.exp2(torch.ceil(16 * torch.log2(r)) / 16)

    calib: dict[int, list[torch.Tensor]] = {}
    with capture_kv(model, lambda i, q, k, v, m: calib.setdefault(i, []).append(rotated_rows(v[:, :, sinks:]))), \
            torch.no_grad():
        for ids in tqdm(corpus.samples, desc="capture"):
            model(ids.reshape(1, -1))
    tables = {}
    g = torch.Generator().manual_seed(0)
    for i in tqdm(sorted(calib), desc=f"fit tables (nu={a.nu})"):
        rows = torch.cat(calib[i])
        rows = rows[torch.randperm(rows.shape[0], generator=g)[: a.fit_rows]]
        t = trellis.fit_table(rows / scale(rows), bits, a.nu, iters=a.iters)
        tables[i] = (t * UNIT).round().clamp(-127, 127) / UNIT

    def tcq(i: int, x: torch.Tensor) -> torch.Tensor:
        rows = rotated_rows(x)
        s = scale(rows)
        y = trellis.decode(trellis.encode(rows / s, tables[i], bits), tables[i], bits) * s
        return apply_transform("hadamard", y.reshape(x.shape), inverse=True).to(x.dtype)

    class Trellis:
        def fake_quant(self, i, side, x):
            if side != "v":
                return plan.fake_quant(i, side, x)
            n = min(sinks, x.shape[2])
            return torch.cat([x[:, :, :n].to(torch.bfloat16).to(x.dtype), tcq(i, x[:, :, n:])], 2)

    windows = text_windows(tok, DATA.read_text(encoding="utf-8"), 1024, a.windows)
    samples = list(windows)
    first: dict[int, torch.Tensor] = {}
    with capture_kv(model, lambda i, q, k, v, m: first.setdefault(i, v[:, :, sinks:].float())), torch.no_grad():
        model(samples[0].reshape(1, -1))
    print(f"\nartifact {a.artifact}: {sinks} sinks; {bits}-bit values, trellis nu={a.nu} ({2 ** (a.nu + bits)}-entry int8 table per layer), "
          f"fitted on {Path(corpus.path).name}\n")
    print("| layer | levels rel. MSE | trellis rel. MSE | gain (dB) |\n|---|---|---|---|")
    for i in sorted(first):
        x = first[i]
        e0 = float((plan.layers[i].v.fake_quant(x, start=sinks) - x).pow(2).sum() / x.pow(2).sum())
        e1 = float((tcq(i, x) - x).pow(2).sum() / x.pow(2).sum())
        print(f"| {i} | {e0:.5f} | {e1:.5f} | {10 * math.log10(e0 / e1):+.2f} |")
    tr = Trellis()
    res = teacher_forced(model, windows, {"levels, all": plan, "levels, V only": side_only(plan, "v"),
                                          "trellis, all": tr, "trellis, V only": side_only(tr, "v")})
    print_protocol_a(res, len(samples), DATA.name, "values")


if __name__ == "__main__":
    main()

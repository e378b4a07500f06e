"""Served vs predicted for llama.cpp's ``-ctk``/``-ctv`` pairs, one table from several ``kvcal verify --engine llamacpp``
documents (``--json``, schema ``kvcal-verify-pairs/1``): the table of docs/results.md (issue 41).

Each row is one pair as one verify run measured it: bytes per token (every layer, K and V, the payload plus the block
scales llama.cpp stores: ``pair_bytes_per_token``), served KL and ΔNLL (llama.cpp against its
own ``f16``/``f16`` run), kvcal's predicted KL and ΔNLL on the same windows, the tolerance and the verdict verify gave.
Rows are ordered by bytes, then served KL. Documents must be of one model and corpus; a pair in two documents is
listed from the one with more windows.

    .venv/bin/python benchmarks/llamacpp_pairs_table.py --model smollm2-135m A.json B.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_of(paths: list[Path]) -> tuple[dict, list[dict]]:
    """``(first document, rows)``: every row of the documents, one per pair (the one on the most windows), each
    with ``windows`` and ``context`` added. ``SystemExit`` naming the file when documents disagree on model/corpus."""
    first, best = None, {}
    for p in paths:
        doc = json.loads(p.read_text())
        if doc.get("schema") != "kvcal-verify-pairs/1":
            sys.exit(f"{p}: not a kvcal verify --engine llamacpp document (schema {doc.get('schema')!r})")
        key = (doc["model"]["id"], doc["corpus"]["sha256"])
        if first is None:
            first = doc
        elif key != (first["model"]["id"], first["corpus"]["sha256"]):
            sys.exit(f"{p}: model/corpus {key} differ from the first document's")
        for r in doc["rows"]:
            r = {**r, "windows": doc["corpus"]["windows"], "context": doc["corpus"]["context"]}
            pair = (r["type_k"], r["type_v"])
            if pair not in best or r["windows"] > best[pair]["windows"]:
                best[pair] = r
    return first, list(best.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("docs", nargs="+", type=Path, help="kvcal verify --engine llamacpp --json documents")
    ap.add_argument("--model", required=True, help="the --model those runs served (for its shape: bytes per token)")
    a = ap.parse_args(argv)
    from kvcal.engines.llamacpp.plan import pair_bytes_per_token
    from kvcal.models.config import load_model_config

    doc, rows = rows_of(a.docs)
    config = load_model_config(a.model)

    def nbytes(r):
        return pair_bytes_per_token(config, r["type_k"], r["type_v"])

    rows.sort(key=lambda r: (nbytes(r), r["served_kl"]))
    print(f"model {doc['model']['id']}; corpus {doc['corpus']['path']}; engine {doc['engine']['display']} "
          f"{doc['engine']['version']}; {len(rows)} pairs")
    print()
    print("| -ctk/-ctv | bytes/token | windows | served KL | predicted KL | diff | tolerance | served ΔNLL | "
          "predicted ΔNLL | verdict |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['type_k']}/{r['type_v']} | {nbytes(r):,.0f} | {r['windows']} x {r['context']} | "
              f"{r['served_kl']:.3e} | {r['predicted_kl']:.3e} | {r['diff']:+.2e} | ±{r['tol']:.2e} | "
              f"{r['served_dnll']:+.4f} | {r['predicted_dnll']:+.4f} | {r['verdict']} |")
    verdicts = [r["verdict"] for r in rows]
    above = sum(r["diff"] > 0 for r in rows)
    print()
    print(f"{verdicts.count('PASS')} PASS, {verdicts.count('INCONCLUSIVE')} INCONCLUSIVE, {verdicts.count('FAIL')} "
          f"FAIL; served above predicted in {above} of {len(rows)}; largest |diff|/tolerance "
          f"{max(abs(r['diff']) / r['tol'] for r in rows):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Reading ``kvcal recommend`` documents."""

from __future__ import annotations


def recommend_bar(doc: dict, scales: str) -> tuple[str, dict]:
    """From a ``kvcal recommend`` document whose every in-budget row was measured on the same windows
    (``measure_all``, ``max_windows == windows``, e.g. ``--accept kl_mean<=0``): the bar ``kl_mean<=B`` under which a
    rerun on the same windows (same arithmetic: the same per-window KLs, so the same bounds) chooses a row with
    ``scales`` ("calibrated" / "vLLM default (1.0)"), and that row: the cheapest deployable one whose KL upper bound
    (the one its PASS is judged on) is below that of every other row with as few or fewer bytes per token (its twin
    at the other scales included), so that it passes at ``B`` = its bound and nothing cheaper or as cheap does.
    Fails the test when there is none."""
    rows = [c for c in doc["candidates"] if c["deployable"] and "kl_mean" in c]

    def up(c):
        return c["bounds"]["kl_mean"]["upper"]

    for r in sorted((c for c in rows if c["scales"] == scales), key=lambda c: c["bytes_per_token"]):
        if all(c is r or up(c) > up(r) for c in rows if c["bytes_per_token"] <= r["bytes_per_token"]):
            return f"kl_mean<={up(r)!r}", r
    raise AssertionError(f"no {scales} row has the lowest KL bound at its bytes per token: the test's premise fails")

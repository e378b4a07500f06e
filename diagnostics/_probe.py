"""Shared start of the ``probe_*.py`` diagnostics: an artifact's plan and the model it was calibrated on.

Imported by the probe scripts, which run with ``diagnostics/`` on ``sys.path`` (``python diagnostics/probe_*.py``)."""

from __future__ import annotations


def load_probe(artifact: str, model_id: str | None = None, check=None):
    """``(artifact, plan, tokenizer, model)`` for the kvcal artifact directory ``artifact``.

    ``model_id``: the model to probe (default: the one the artifact was calibrated on). ``check``:
    called with the plan before the model loads (a probe refuses a layout it cannot handle there). Raises
    what :func:`kvcal.artifact.load_artifact` and :func:`kvcal.artifact.check_model_match` raise
    (a missing/tampered artifact, a model whose shape does not match)."""
    from kvcal.artifact import check_model_match, load_artifact
    from kvcal.models import load_model, load_tokenizer, model_metadata
    from kvcal.plan import KVPlan

    art = load_artifact(artifact)
    plan = KVPlan.from_artifact(art.tensors, art.metadata)
    if check is not None:
        check(plan)
    model_id = model_id or art.metadata["model"]["id"]
    tok, model = load_tokenizer(model_id), load_model(model_id)
    check_model_match(art.metadata, model_metadata(model.config, getattr(model, "kvcal_source", None),
                                                   architecture=type(model).__name__))
    return art, plan, tok, model


def print_protocol_a(res: dict, windows: int, source: str, label: str, top1: bool = False) -> None:
    """Print :func:`kvcal.evaluate.protocol_a.teacher_forced`'s result ``res`` as a markdown table.

    ``res``: ``{name: {"kl_mean", "delta_ppl", "top1_agree", ...}}`` with the ``"16-bit"`` reference row
    (its perplexity goes in the heading, the row itself is left out); ``windows``: how many 1024-token
    windows of the text file named ``source`` were scored; ``label``: the first column's heading; ``top1``:
    add the top-1 agreement column. Mean KL in nats per token, ΔPPL in perplexity points."""
    head = f"| {label} | mean KL (nats) | ΔPPL |" + (" top-1 |" if top1 else "")
    print(f"\n{windows} x 1024-token windows of {source} (16-bit ppl {res['16-bit']['ppl']:.3f})\n\n"
          f"{head}\n|---|---|---|" + ("---|" if top1 else ""))
    for name, r in res.items():
        if name != "16-bit":
            print(f"| {name} | {r['kl_mean']:.3e} | {r['delta_ppl']:+.4f} |" + (f" {r['top1_agree']:.1%} |" if top1 else ""))

"""Commands that read an artifact: ``kvcal export``, ``kvcal inspect`` and ``kvcal report``."""

from __future__ import annotations

import shlex

import click

from kvcal.cli.common import count, main, user_errors


# ---- export ------------------------------------------------------------------------------------
@main.command("export")
@click.option("--artifact", required=True, type=click.Path(), help="kvcal artifact directory (kv_scales.safetensors).")
@click.option("--target", required=True,
              help="vllm (= compressed-tensors), modelopt, trtllm-legacy or sglang-json (= quantization-param-path).")
@click.option("--out", required=True, type=click.Path(), help="New output directory (written atomically).")
@click.option("--model-dir", default=None, type=click.Path(),
              help="HF safetensors checkpoint to merge into (a copy goes to --out, weight files hard-linked; the source is untouched).")
@click.option("--tp", default=1, show_default=True, type=count(1), help="Tensor-parallel ranks (sglang-json entries).")
@click.option("--headroom", default=None, type=float,
              help="Margin in [1, 16]: raise every scale to >= observed max / 448 x MARGIN after the search (for "
                   "traffic above the calibration max in an engine that does not saturate); export prints its cost.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--clip-free", is_flag=True,
              help="Write the clip-free scales the search chose and measured (nothing the calibration observed "
                   "saturates), for serving a vllm/modelopt checkpoint in SGLang, which casts to FP8 without "
                   "saturating. Default: the searched scales (vllm, modelopt, trtllm-legacy); sglang-json always "
                   "gets the clip-free ones.")
@click.option("--clipped-scales", is_flag=True,
              help="Write the searched scales even for sglang-json (values they clip become NaN in SGLang).")
@user_errors
def export_cmd(artifact, target, out, model_dir, tp, headroom, overwrite, clip_free, clipped_scales):
    """Export an artifact in the exact form a serving engine loads (optionally merged into a checkpoint)."""
    from kvcal import api

    res = api.export(artifact, target, out, model_dir=model_dir, tp=tp, headroom=headroom, overwrite=overwrite,
                 clipped_scales=clipped_scales, clip_free=clip_free)
    click.echo(f"wrote {res.out} ({res.target}): {', '.join(res.files)}")
    for note in res.notes:
        click.echo(f"note: {note}")
    for warn in res.warnings:
        click.echo(f"warning: {warn}", err=True)
    if model_dir is None and res.target in ("vllm", "modelopt"):
        # the serve line names the merged checkpoint, not this standalone directory (it holds no weights)
        serve = res.serve.replace(shlex.quote(str(res.out)), "MERGED_OUT")  # export quotes the path it prints
        click.echo(f"next: merge into the checkpoint with --model-dir HF_DIR --out MERGED_OUT (engines load scales "
                   f"from a full checkpoint), then e.g.: {serve}")
    else:
        click.echo(f"serve: {res.serve}")


# ---- inspect -----------------------------------------------------------------------------------
@main.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--tp", default=None, type=count(1), help="TP size to check a --quantization-param-path JSON against.")
@user_errors
def inspect_cmd(path, tp):
    """Show what an artifact, export or checkpoint holds and what vLLM / SGLang / TensorRT-LLM would load."""
    from kvcal import api
    from kvcal.inspect import render

    click.echo(render(api.inspect(path, tp=tp)))


# ---- report ------------------------------------------------------------------------------------
@main.command("report")
@click.option("--artifact", required=True, type=click.Path(), help="kvcal artifact directory.")
@click.option("--eval", "eval_json", default=None, type=click.Path(),
              help="Evaluation JSON from `kvcal evaluate --json` (adds quality figures and the verdict).")
@click.option("--out", default=None, type=click.Path(), help="Output directory [default: the artifact directory].")
@user_errors
def report_cmd(artifact, eval_json, out):
    """Render the disclosure report (report.md + figures/ and a self-contained report.html)."""
    from kvcal import api

    res = api.report(artifact, eval_json, out)
    click.echo(f"wrote {res['markdown']} ({len(res['figures'])} figures) and {res['html']}")

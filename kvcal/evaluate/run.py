"""``kvcal evaluate``: the options (:class:`EvalConfig`) and the driver (:func:`evaluate`).

:func:`evaluate` checks every input before the model loads (artifact, context against the
model's ``max_position_embeddings``, corpus format and length, the plan the artifact describes),
cuts ``windows`` consecutive windows per context from one token stream
(:func:`~kvcal.evaluate.windows.corpus_stream`), then runs the artifact's plan, the baselines
(:mod:`kvcal.evaluate.baselines`) and any ``vllm:<dtype>`` rows in the modes asked for —
Protocol A (:func:`~kvcal.evaluate.protocol_a.teacher_forced`) and decode mode
(:func:`~kvcal.evaluate.decode.decode_eval`) — judges every row against its acceptance bar
(:mod:`kvcal.evaluate.accept`), and returns the ``kvcal-eval/1`` document
(:mod:`kvcal.evaluate.document`). ``doc["passed"]`` is False when any row of the artifact under
test fails its criteria (the CLI exits 1). ``teacher_forced`` rows are computed once per context
and reported with the largest batch regime that was used to run them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvcal.evaluate.accept import default_accept, parse_accept, plan_bits
from kvcal.evaluate.baselines import (
    artifact_amax,
    baseline_plans,
    capture_amax,
    describe_plan,
    per_layer_errors,
)
from kvcal.evaluate.bounds import LEVEL, judge_bounded
from kvcal.evaluate.decode import decode_eval
from kvcal.evaluate.document import SCHEMA
from kvcal.evaluate.protocol_a import teacher_forced
from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos


@dataclass(frozen=True)
class EvalConfig:
    """Options of ``kvcal evaluate`` (defaults in one place). ``contexts``/``batches``: regimes;
    ``windows``: evaluation windows per context; ``decode_tokens``: positions decoded one at a
    time after the prefill; ``greedy_tokens``: greedy-agreement length (0 disables);
    ``accept``: criteria applied to every method (``None``:
    :data:`~kvcal.evaluate.accept.DEFAULT_ACCEPT` per precision); ``modes``: subset of
    ``("teacher_forced", "decode")``; ``per_layer_tokens``: window length of the per-layer error
    pass (0 disables). Invalid options raise :class:`~kvcal.errors.KvcalError` on construction."""

    artifact: str
    corpus: str
    model: str | None = None
    contexts: tuple[int, ...] = (1024,)
    batches: tuple[int, ...] = (1,)
    windows: int = 8
    decode_tokens: int = 128
    greedy_tokens: int = 32
    baselines: bool = True
    accept: str | None = None
    modes: tuple[str, ...] = ("teacher_forced", "decode")
    per_layer_tokens: int = 1024
    kivi_window: int = 32
    device: str = "cpu"
    text_field: str | None = None  # corpus options, as kvcal.corpus.load_corpus
    messages_field: str | None = None
    split: str | None = None
    vllm_dtypes: tuple[str, ...] = ()  # vLLM --kv-cache-dtype values evaluated side by side (rows "vllm:<dtype>")
    backend: str = "cuda"  # vLLM attention backend whose write path the vllm:* rows emulate (cuda, cpu)

    def __post_init__(self):
        from kvcal.errors import KvcalError

        eng = _rows_engine()
        try:
            object.__setattr__(self, "backend", eng.backend(self.backend).name)
        except eng.DTypeError as e:
            raise KvcalError(f"--backend: {e}") from None
        try:
            eng.check_dtypes_served(self.backend, self.vllm_dtypes)
        except eng.DTypeError as e:
            raise KvcalError(f"--vllm-dtype: {e}") from None
        if self.backend != "cuda" and not self.vllm_dtypes:  # it would change no row: refused, not ignored
            raise KvcalError(f"--backend {self.backend} chooses the write path of the vllm:* rows, and there are none: "
                             f"add --vllm-dtype fp8 (or drop --backend)")

        if not self.contexts or any(int(c) < 2 for c in self.contexts):
            raise KvcalError("--context values must be integers >= 2 (e.g. 1024,4096,8192)")
        if not self.batches or any(int(b) < 1 for b in self.batches):
            raise KvcalError("--batch values must be integers >= 1 (e.g. 1,8)")
        if self.windows < 1:
            raise KvcalError("--windows must be at least 1")
        if self.decode_tokens < 1:
            raise KvcalError("--decode-tokens must be at least 1")
        bad = set(self.modes) - {"teacher_forced", "decode"}
        if bad or not self.modes:
            raise KvcalError(f"modes must be teacher_forced and/or decode, got {sorted(bad) or 'none'}")
        if self.accept is not None:
            parse_accept(self.accept)
        from kvcal.models import check_device

        check_device(self.device)


def evaluate(cfg: EvalConfig, log: Callable[[str], None] = print, progress: bool = True,
             model=None, tokenizer=None, corpus=None) -> dict:
    """Run ``kvcal evaluate``: the artifact and (optionally) the baselines, in both modes, at every
    context/batch regime. Returns the ``kvcal-eval/1`` document (schema: :mod:`kvcal.evaluate.document`).

    ``model``/``tokenizer``: already-loaded objects for ``cfg.model`` (tests); loaded offline
    otherwise. ``corpus``: ``cfg.corpus`` already checked (:class:`kvcal.inputs.CorpusInput`, :mod:`kvcal.api`'s
    preflight); checked here when None. The model is resolved once (:func:`kvcal.inputs.preflight`). Raises
    :class:`~kvcal.errors.KvcalError` for a bad artifact (incl. a model mismatch), corpus or options."""
    import datetime as _dt
    import time

    from kvcal import __version__
    from kvcal.artifact import artifact_sha256, check_model_match, engine_section
    from kvcal.artifact.deployed import load_artifact_or_export
    from kvcal.errors import ArtifactError, KvcalError
    from kvcal.formats.memory import model_shape
    from kvcal.models import check_max_positions, load_model, load_tokenizer, model_metadata
    from kvcal.plan import KVPlan

    art = load_artifact_or_export(cfg.artifact)  # an export directory: the scales its files hold
    dep = art.metadata.get("deployed")
    art_max = (art.metadata.get("model") or {}).get("max_position_embeddings")
    if isinstance(art_max, int):  # before loading the model
        check_max_positions(max(int(c) for c in cfg.contexts), art_max, "--context", " (artifact metadata)")
    # every input error before the model loads: corpus format and fields (no tokenizer), the plan the
    # artifact describes, the model's shape from its config, then the token stream (tokenizer only)
    from kvcal.corpus import txt_token_bound
    from kvcal.inputs import corpus_input, preflight

    corpus = corpus_input(cfg.corpus, corpus, text_field=cfg.text_field, messages_field=cfg.messages_field,
                          split=cfg.split)
    bound, t_max = txt_token_bound(cfg.corpus), max(int(c) for c in cfg.contexts)
    if bound is not None and bound < t_max:  # too short for one window whatever the tokenizer: say so before it loads
        raise KvcalError(f"corpus {cfg.corpus} has at most {bound:,} tokens (3 per byte of its size); context "
                         f"{t_max} needs at least {t_max} (use a longer corpus or a smaller --context)")
    try:
        plan = KVPlan.from_artifact(art.tensors, art.metadata)
    except (ValueError, KeyError) as e:
        raise ArtifactError(f"{art.path}: {e}") from None
    hd = (art.metadata.get("model") or {}).get("head_dim")
    if isinstance(hd, int) and hd > 0:  # a --vllm-dtype the model's head_dim cannot hold (nvfp4: multiple of 16)
        eng = _rows_engine()
        for d in cfg.vllm_dtypes:
            try:
                eng.check_head_dim(d, hd)
                eng.check_backend_serves(cfg.backend, d, hd)
            except eng.DTypeError as e:
                raise KvcalError(f"--vllm-dtype {d}: {e}; drop it from --vllm-dtype") from None
    pre = preflight(cfg.model, corpus, loaded=model)  # the model's config, read once
    if model is None:
        meta = model_metadata(pre.model.config, pre.model.source)
        check_model_match(art.metadata, meta)
        check_max_positions(max(int(c) for c in cfg.contexts), meta.get("max_position_embeddings") or 0, "--context")
    tok = tokenizer if tokenizer is not None else load_tokenizer(pre.model.source or cfg.model, vocab_size=pre.model.vocab_size)
    contexts = sorted({int(c) for c in cfg.contexts})
    batches = sorted({int(b) for b in cfg.batches})
    ids, corpus_info = corpus_stream(cfg.corpus, tok, **pre.corpus.options, checked=True)
    bos = served_bos(tok)  # a window starts with BOS where the tokenizer adds one, as the model is served
    wins = {}
    for T in contexts:
        w = cut_windows(ids, T, cfg.windows, bos=bos)
        if len(w) == 0:
            raise KvcalError(f"corpus {cfg.corpus} has {ids.numel()} tokens; context {T} needs at least {T} "
                             "(use a longer corpus or a smaller --context)")
        wins[T] = w
    if model is None:
        model = load_model(pre.model.source or cfg.model, device=cfg.device)
    mm = model_metadata(model.config, getattr(model, "kvcal_source", None), architecture=type(model).__name__)
    check_model_match(art.metadata, mm)
    L = plan.num_layers
    shp = model_shape(model.config)
    max_pos = mm.get("max_position_embeddings") or 0
    check_max_positions(contexts[-1], max_pos, "--context")
    notes = []
    if dep:
        notes.append(f"judged: the {dep['target']} export {dep['path']} — the scales read from its files "
                     f"({dep['scales'] or 'scale set not recorded'}; {dep['changed']} K/V scales differ from the "
                     f"artifact {dep['source_artifact']} it was exported from), the artifact's model and format"
                     + ("; the q_scale the checkpoint holds (kept from --model-dir: vLLM reads it)"
                        if dep.get("q_scale_from_checkpoint") else "")
                     + ("" if dep.get("source_hash_checked", True) else
                        "; this export predates the recorded artifact hash, so the source artifact could not be "
                        "checked to be the one exported") + ".")
        log(notes[-1])
    device_kind = str(next(model.parameters()).device)
    if device_kind.startswith("cpu"):
        notes.append("CPU run: throughput is not measured; the figures are memory and quality only "
                     "(decode-step timings on CPU say nothing about GPU serving speed).")

    plans: dict[str, object] = {"artifact": plan}
    roles = {"16-bit": "reference", "artifact": "artifact"}
    if cfg.baselines:
        amax = artifact_amax(art.metadata)
        if amax is None:
            extra = cut_windows(ids, contexts[0], 2, skip=cfg.windows, bos=bos)
            if len(extra):
                amax = capture_amax(model, extra, L)
                notes.append(f"fp8-absmax: the artifact records no per-layer amax; absmax was captured on "
                             f"{len(extra)} windows of {contexts[0]} tokens after the evaluation windows "
                             "(disjoint from them).")
            else:
                notes.append("fp8-absmax omitted: no amax in the artifact and no corpus left after the "
                             "evaluation windows for a calibration capture.")
        else:
            notes.append("fp8-absmax: scales = per-layer calibration absmax (artifact metadata) / 448.")
        for name, p in baseline_plans(L, amax, cfg.kivi_window).items():
            plans[name] = p
            roles[name] = "baseline"
        notes.append(f"kivi4/kivi2 keep the {cfg.kivi_window} most recent tokens in 16 bits in decode mode "
                     "(KIVI's residual); teacher-forced rows quantize every key/value attention reads.")
    engine_rows = set()  # the methods run as the engine serves them (vllm:<dtype>)
    sec = engine_section(art.metadata)
    # an artifact calibrated for a vLLM dtype and backend is judged as that engine serves it (issue 40, class 1):
    # the vllm:<its dtype> row sets the verdict, added with the artifact's backend when --vllm-dtype omits it
    backend_of = dict.fromkeys(cfg.vllm_dtypes, cfg.backend)
    served_d = None
    if sec is not None and sec.kv_cache_dtype:
        served_d = next((d for d in cfg.vllm_dtypes if _rows_engine().same_dtype(d, sec.kv_cache_dtype)), None)
        if served_d is None:
            served_d = sec.kv_cache_dtype
            backend_of[served_d] = sec.backend
            notes.append(f"vllm:{served_d} added (backend {sec.backend}): the artifact was calibrated for vLLM "
                         f"--kv-cache-dtype {sec.kv_cache_dtype} on that backend, and is judged as it serves it")
            log(notes[-1])
        elif cfg.backend != sec.backend:
            notes.append(f"the artifact was calibrated for backend {sec.backend}; vllm:{served_d} runs backend "
                         f"{cfg.backend} as --backend asks, and its verdict is for that backend")
    for d in backend_of:
        eng = _rows_engine()
        qt = [art.tensors.get(f"model.layers.{i}.self_attn.q_scale") for i in range(L)]  # calibrate --engine vllm
        nv = sec.nvfp4_dtype if sec else None  # --kv-cache-dtype nvfp4 artifact
        kw = ({"q_scales": [t.reshape(-1) if t.numel() > 1 else float(t.reshape(-1)[0]) for t in qt]}
              if eng.dtype(d).family == "fp8" and all(t is not None for t in qt) and nv is None else {})
        if d == nv:  # its NVFP4 outer scales (vLLM's k_scale/v_scale) and q_scale, per tensor
            kw = {f"{s}_scales": [float(art.tensors[f"model.layers.{i}.self_attn.{s}_outer_scale"].reshape(-1)[0])
                                  for i in range(L)] for s in "kv"}
            kw["q_scales"] = [float(t.reshape(-1)[0]) for t in qt]
        art_skip = sec.skip_layers_for(d) if sec else ()
        if art_skip:  # calibrate --skip-layers / recommend: the 16-bit layers its export serves with
            kw["skip_layers"] = art_skip
        plans[f"vllm:{d}"], note = eng.Plan.from_kvcal_plan(d, plan, backend=backend_of[d], **kw)
        roles[f"vllm:{d}"] = "vllm"
        engine_rows.add(f"vllm:{d}")
        notes.append(note + (f"; layers {', '.join(map(str, art_skip))} in the model dtype (the artifact's "
                             "--kv-cache-dtype-skip-layers)" if art_skip else ""))
    skip_all = sec.skip_layers if sec else None
    if skip_all:
        dt = sec.kv_cache_dtype
        notes.append(f"artifact rows: kvcal's runtime cache quantizes every layer; vLLM serves this artifact's export "
                     f"with layers {', '.join(map(str, skip_all))} in the model dtype (--kv-cache-dtype-skip-layers), "
                     + ("measured in the vllm:* row of its dtype" if any(sec.skip_layers_for(d) for d in cfg.vllm_dtypes)
                        else f"which --vllm-dtype {dt} measures"))
    if engine_rows and "decode" in cfg.modes:
        notes.append("vllm:* rows are teacher-forced only: every vLLM dtype quantizes each token's K/V on its own "
                     "(static or per-token scales), so a decode step reads exactly what Protocol A reads at that "
                     "position; kvcal's runtime cache does not hold vLLM layouts.")
    crit_str = {name: cfg.accept or default_accept(p) for name, p in plans.items()}
    crit = {name: parse_accept(s) for name, s in crit_str.items()}
    methods = {"16-bit": {"role": "reference", "label": f"unquantized K/V ({str(next(model.parameters()).dtype).replace('torch.', '')})",
                          "k": None, "v": None, "residual_window": 0, "sink_tokens": 0, "quantized_tensors": [],
                          "bits": 16, "criteria": ""}}
    for name, p in plans.items():
        desc = ({"k": None, "v": None, "residual_window": 0, "sink_tokens": 0,
                 "quantized_tensors": ["k", "v"] if p.quantized_bits() else [], **p.describe(),
                 "label": f"vLLM --kv-cache-dtype {p.kv_cache_dtype}"
                          + ("" if p.backend == "cuda" else f" (backend {p.backend})"), "bits": plan_bits(p)}
                if name in engine_rows else describe_plan(p))
        methods[name] = {"role": roles[name], **desc, "criteria": crit_str[name]}

    results, measured = [], []

    def add_rows(res: dict, mode: str, T: int, B: int, n_windows: int, seconds: float):
        for name, r in res.items():
            row = {"method": name, "mode": mode, "context": T, "batch": B,
                   **{k: r.get(k) for k in ("ppl", "delta_ppl", "kl_mean", "kl_p999", "top1_agree")},
                   "greedy_agree": r.get("greedy_agree"), "greedy_prefix": r.get("greedy_prefix"),
                   "tokens": r["tokens"], "windows": n_windows, "seconds": round(seconds, 2),
                   "per_window": r.get("per_window")}
            if name == "16-bit":
                row.update(status="REFERENCE", criteria="", failed=[])
            else:  # judged on one-sided bounds over the windows (kvcal.evaluate.bounds), never the estimate alone
                j = judge_bounded(row, crit[name])
                row.update(status=j["status"], criteria=crit_str[name], failed=j["failed"], bounds=j["bounds"],
                           windows_needed=j["windows_needed"])
            results.append(row)

    eval_tokens = {}
    for T in contexts:
        w = wins[T]
        if "teacher_forced" in cfg.modes:
            bsz = min(batches[-1], len(w))
            t0 = time.perf_counter()
            log(f"teacher-forced: {len(w)} windows x {T} tokens, {len(plans)} methods")
            res = teacher_forced(model, w, plans, batch_size=bsz, progress=progress)
            add_rows(res, "teacher_forced", T, bsz, len(w), time.perf_counter() - t0)
            eval_tokens.setdefault(str(T), {})["teacher_forced"] = res["16-bit"]["tokens"]
        if "decode" in cfg.modes:
            for B in batches:
                t0 = time.perf_counter()
                log(f"decode: {len(w)} windows x {T} tokens, batch {B}, {min(cfg.decode_tokens, T - 1)} decoded "
                    f"positions each, {len(plans)} methods")
                meas: list = []
                res = decode_eval(model, w, {n: p for n, p in plans.items() if n not in engine_rows}, B,
                                  cfg.decode_tokens, cfg.greedy_tokens, progress, meas)
                add_rows(res, "decode", T, B, len(w), time.perf_counter() - t0)
                eval_tokens.setdefault(str(T), {})["decode"] = res["16-bit"]["tokens"]
                for m in meas:
                    measured.append({**m, "context": T})
                    if m["allocated_bytes"] != m["expected_bytes"]:
                        notes.append(f"{m['method']}: runtime cache held {m['allocated_bytes']} bytes, the accounting "
                                     f"says {m['expected_bytes']}: accounting and allocation disagree (a bug: please report)")

    per_layer = {}
    if cfg.per_layer_tokens:
        T0 = min(contexts[0], cfg.per_layer_tokens)
        log(f"per-layer errors on one window of {T0} tokens")
        per_layer = per_layer_errors(model, wins[contexts[0]][:1, :T0], plans)

    memory = memory_section(plans, engine_rows, shp, L, contexts, batches, measured)

    judged_method = f"vllm:{served_d}" if served_d is not None else "artifact"
    if served_d is not None:
        notes.append(f"verdict: the {judged_method} row ({backend_of[served_d]} write path), how vLLM serves this "
                     "artifact's export; the artifact rows (kvcal's runtime: every layer quantized, rounding "
                     "writes, no query quantization) are shown beside it and set neither the verdict nor the exit "
                     "code")
    art_rows = [r for r in results if r["method"] == judged_method]
    passed = bool(art_rows) and all(r["status"] == "PASS" for r in art_rows)
    notes.append(f"PASS/FAIL: every clause judged on a one-sided {LEVEL:.0%} Student-t bound over the evaluation "
                 "windows (the upper bound of a <= clause, the lower of a >=; ΔPPL from the paired per-window NLL "
                 "differences; kl_p999 on its estimate); INCONCLUSIVE when the bound straddles the bar, with the "
                 "windows that would decide it")
    calib = art.metadata.get("calibration")
    doc = {
        "schema": SCHEMA,
        "kvcal_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": passed,
        "exit_code": 0 if passed else 1,
        "judged_method": judged_method,
        "verdict": ("PASS" if passed else "FAIL" if not art_rows or any(r["status"] == "FAIL" for r in art_rows)
                    else "INCONCLUSIVE"),
        "artifact": {"path": str(art.path), "kv": art.metadata["kv"], "calibration": calib,
                     "corpus": art.metadata.get("corpus"),
                     "sha256": artifact_sha256(dep["source_artifact"] if dep else art.path),
                     **({"deployed": dep} if dep else {})},
        "model": mm,
        "corpus": {**corpus_info, "windows": {str(T): len(wins[T]) for T in contexts},
                   "window_source": window_source(corpus_info["kind"], bos),
                   "eval_tokens": eval_tokens, **({"bos_token_id": bos} if bos is not None else {})},
        "regimes": [{"context": T, "batch": B} for T in contexts for B in batches],
        "methods": methods,
        "results": results,
        "per_layer": per_layer,
        "memory": memory,
        "description": {
            "quantized_tensors": {n: m["quantized_tensors"] for n, m in methods.items()},
            "formats": {n: m["label"] for n, m in methods.items()},
            "weight_precision": mm.get("weight_precision"),
            "key_position": plan.key_position,
            "device": device_kind,
            "throughput": ("not measured (CPU run: memory and quality only)" if device_kind.startswith("cpu")
                           else "not measured by kvcal evaluate"),
            "context_regimes": contexts, "batch_regimes": batches,
            "decode_tokens": cfg.decode_tokens, "greedy_tokens": cfg.greedy_tokens,
            "modes": list(cfg.modes),
        },
        "notes": notes,
    }
    short = [T for T in contexts if "decode" in cfg.modes and cfg.decode_tokens > T - 1]
    if short:  # decode_eval decodes min(decode_tokens, T - 1) positions: the prompt keeps at least 1 token
        notes.append(f"--decode-tokens {cfg.decode_tokens} exceeds context {', '.join(map(str, short))} − 1: "
                     + ", ".join(f"{T - 1} tokens decoded at context {T}" for T in short))
        doc["description"]["decode_tokens_by_context"] = {str(T): min(cfg.decode_tokens, T - 1) for T in contexts}
    return doc


def window_source(kind: str, bos: int | None) -> str:
    """How the evaluation windows were cut, as the document and the report state it (``bos``: the BOS id every
    window starts with, :func:`~kvcal.evaluate.windows.served_bos`; ``None``: none added)."""
    if bos is None:
        return ("whole file tokenized at once (no BOS), consecutive windows from the start" if kind == "txt" else
                "samples concatenated in file order, consecutive windows from the start")
    src = "whole file tokenized at once" if kind == "txt" else "samples concatenated in file order"
    return (f"{src}; every window starts with BOS (token {bos}) followed by context - 1 consecutive tokens, as the "
            "model is served (its tokenizer adds BOS to every prompt); the BOS position is not predicted")


def memory_section(plans: dict, engine_rows: set, shp, num_layers: int, contexts: list[int], batches: list[int],
                   measured: list) -> dict:
    """The ``"memory"`` section of the document: exact KV-cache bytes per token and per
    (context, batch) regime of every method, from :mod:`kvcal.formats.memory` (kvcal plans:
    ``bytes_per_token`` / ``cache_bytes`` of each layer's ``kv_config``; ``vllm:<dtype>`` methods:
    vLLM's page layout, skipped layers at 16 bits), ``vs_16bit`` against the bf16 cache of the same
    regime (:func:`~kvcal.formats.memory.cache_bytes`: sliding-window layers hold at most ``W - 1`` tokens in
    both). ``shp``: :func:`kvcal.formats.memory.model_shape`; ``measured``: decode mode's runtime
    allocations, stored as given."""
    from kvcal.formats.memory import bytes_per_token, cache_bytes
    from kvcal.formats.spec import preset

    L = num_layers
    b16 = int(bytes_per_token(shp, preset("bf16")))
    memory = {"bytes_per_token": {}, "bytes_per_token_16bit": b16, "cache_bytes": {}, "measured": measured}
    for name, p in plans.items():
        if name in engine_rows:  # the pages the engine allocates (its facade: bytes_per_token, cache_bytes)
            eng = _rows_engine()
            memory["bytes_per_token"][name] = eng.bytes_per_token(shp, p.kv_cache_dtype, p.skipped)
            memory["cache_bytes"][name] = [
                {"context": T, "batch": B, "bytes": (nb := eng.cache_bytes(shp, p.kv_cache_dtype, T, B,
                                                                          skip_layers=p.skipped)),
                 "vs_16bit": nb / cache_bytes(shp, preset("bf16"), T, B)} for T in contexts for B in batches]
            continue
        cfgs = [p.kv_config(i) for i in range(L)]
        memory["bytes_per_token"][name] = bytes_per_token(shp, cfgs)
        memory["cache_bytes"][name] = []
        for T in contexts:
            for B in batches:
                nb = cache_bytes(shp, cfgs, T, B)
                memory["cache_bytes"][name].append({"context": T, "batch": B, "bytes": nb,
                                                    "vs_16bit": nb / cache_bytes(shp, preset("bf16"), T, B)})
    return memory


#: The engine whose dtypes ``--vllm-dtype`` names (rows ``vllm:<dtype>``, :attr:`EvalConfig.vllm_dtypes`).
ROWS_ENGINE = "vllm"


def _rows_engine():
    """The facade of :data:`ROWS_ENGINE` (:mod:`kvcal.engines`): its dtypes, backends, plans and pages."""
    from kvcal.engines import engine

    return engine(ROWS_ENGINE)

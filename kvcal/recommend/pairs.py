"""``kvcal recommend`` for an engine whose KV cache is chosen as a K type and a V type (llama.cpp's
``-ctk``/``-ctv``) and loads no calibrated scale: which pair to deploy, measured on the user's corpus.

Menu: every ordered pair ``(type_k, type_v)`` of ``cfg.cache_types`` (the engine's ``PAIR_TYPES`` by default) but
the 16-bit pair itself (the reference). Each pair runs as the engine's plan (``pair_plan``: for llama.cpp the exact
write of ggml's block formats with the Hadamard rotation llama.cpp applies to quantized caches, and the query
conversion its flash attention does, :class:`kvcal.engines.llamacpp.plan.LlamaCppKVPlan`) under Protocol A on the
corpus's evaluation windows (:class:`kvcal.evaluate.sequential.WindowedRows`: one shared 16-bit reference), and is
judged on one-sided Student-t bounds over windows (:func:`kvcal.evaluate.bounds.judge_bounded`). For a GGUF model the
reference and every row run their weight matmuls as the engine does (the facade's ``MatmulInputs``: llama.cpp
rounds each matmul's input to the weight type's ``vec_dot_type``), because the KL llama.cpp serves for a pair
includes that re-rounding of every activation the cache error moves (measured by ``kvcal verify --engine
llamacpp``: on the embedded Q4_1 model, ``q8_0``/``q8_0`` serves 16x the KL of float32 matmuls). Rows are measured
cheapest first (bytes per token as the engine allocates them, then the order of the menu); a row whose bound
straddles the bar gets more windows (doubling from ``windows`` up to ``max_windows``); once a row passes, dearer
rows are left unmeasured (``measure_all`` measures them all). The chosen row is the cheapest PASS (ties: lower KL).
The pairs users run by folklore (the engine's ``COMMON_PAIRS``: ``q8_0``/``q8_0``, ``q4_0``/``q4_0``) are always
measured on the chosen row's windows, so the document says what the calibrated choice gains over them, at what
bytes.

Bar: ``cfg.accept``, else kvcal evaluate's 8-bit bar (:data:`kvcal.evaluate.accept.DEFAULT_ACCEPT` [8]) for every
pair — one bar for the whole menu, so that "cheapest that passes" compares like with like.

Output directory (atomic): ``deploy.json`` (``kvcal-recommend/1`` with ``"menu": "pairs"``) and ``deploy.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from kvcal.errors import KvcalError

#: kvcal evaluate's bar for an 8-bit cache, applied to every pair when ``--accept`` is not given
PAIR_DEFAULT_BITS = 8


def is_pair_engine(name: str) -> bool:
    """Whether engine ``name`` is recommended as K/V type pairs (its facade defines ``pair_plan``)."""
    from kvcal.engines import has

    return has(name, "pair_plan")


def check_pair_options(cfg, corpus=None) -> tuple:
    """The checks before any model loads: the cache types, options that belong to other engines (refused, not
    ignored), the bar, windows, output directory and corpus files. Returns ``(corpus, eval corpus or None)``
    checked (:class:`kvcal.inputs.CorpusInput`; ``corpus``: ``cfg.corpus`` already checked, not checked again). Raises :class:`KvcalError` naming the option."""
    from kvcal.engines import engine
    from kvcal.recommend.checks import check_common
    from kvcal.recommend.config import DEFAULT_MENU

    eng = engine(cfg.engine)
    other = [name for name, given in (("--dtypes", tuple(cfg.dtypes) != DEFAULT_MENU),
                                      ("--max-skip", cfg.max_skip is not None),
                                      ("--backend", cfg.backend != "cuda"),
                                      ("--no-per-head", not cfg.per_head)) if given]
    if other:
        raise KvcalError(f"{', '.join(other)}: not with --engine {cfg.engine}: {eng.DISPLAY_NAME} is chosen as a K "
                         "and a V cache type (-ctk/-ctv) for every layer; name the types with --cache-types")
    types = cache_types(cfg)
    if len(types) < 1:
        raise KvcalError("--cache-types is empty; name at least one cache type (e.g. q8_0,q4_0)")
    for t in types:
        try:
            eng.ggml_type(t)
        except KvcalError as e:
            raise KvcalError(f"--cache-types: {e}") from None
    if len(set(types)) != len(types):
        raise KvcalError(f"--cache-types {','.join(types)} names a type twice; give each once")
    return check_common(cfg, corpus)


def cache_types(cfg) -> tuple[str, ...]:
    """The cache types paired: ``cfg.cache_types`` or the engine's ``PAIR_TYPES``."""
    from kvcal.engines import engine

    return tuple(cfg.cache_types) if cfg.cache_types else tuple(engine(cfg.engine).PAIR_TYPES)


def pair_menu(types: tuple[str, ...], sixteen: str = "f16") -> list[tuple[str, str]]:
    """Every ordered ``(type_k, type_v)`` of ``types`` except ``(sixteen, sixteen)``, the 16-bit reference (K
    varies slowest)."""
    return [(k, v) for k in types for v in types if not (k == sixteen and v == sixteen)]


def recommend_pairs(cfg, log: Callable[[str], None] = print, progress: bool = True, model=None, tokenizer=None,
                    corpus=None) -> dict:
    """Run ``kvcal recommend --engine <pair engine>`` (module doc) and write ``cfg.out`` atomically; returns the
    document: ``{"schema", "menu": "pairs", "engine", "engine_version", "model", "passed", "chosen", "commands":
    {"export": None, "serve"} | None, "common": [rows of the engine's COMMON_PAIRS], "candidates": [{"type_k",
    "type_v", "dtype" ("K/V"), "bytes_per_token", "vs_16bit", "criteria", "status", "failed", "kl_mean",
    "delta_ppl", "ppl", "top1_agree", "kl_p999", "windows", "bounds", "windows_needed", "per_window"}], "accept",
    "rotation", "kq_interleaved" (each query/key head quantized in llama.cpp's interleaved order of a llama GGUF,
    :func:`kvcal.engines.llamacpp.plan.kq_interleaved`), "data", "notes"}``. ``model``/``tokenizer``: loaded objects (tests); ``corpus``: ``cfg.corpus``
    already checked. Raises :class:`KvcalError` for bad input, before the model loads."""
    import json
    import shlex

    from kvcal.artifact import write_dir_atomically
    from kvcal.engines import engine, has
    from kvcal.evaluate.accept import DEFAULT_ACCEPT, parse_accept
    from kvcal.evaluate.bounds import INCONCLUSIVE, LEVEL, judge_bounded
    from kvcal.evaluate.sequential import WindowedRows
    from kvcal.evaluate.windows import corpus_stream, cut_windows, served_bos
    from kvcal.formats.memory import model_shape
    from kvcal.inputs import preflight
    from kvcal.models import check_max_positions, load_model, load_tokenizer, resolve_model
    from kvcal.models.gguf import gguf_architecture, gguf_tensor_types
    from kvcal.recommend.config import NOT_MEASURED, SCHEMA
    from kvcal.recommend.render import render_pairs_markdown

    eng = engine(cfg.engine)
    corpora = check_pair_options(cfg, corpus)
    pre = preflight(cfg.model, corpora[0], eval_corpus=corpora[1], loaded=model)
    mconf = pre.model.config
    check_max_positions(cfg.context, pre.model.max_positions, "--context")
    shp = model_shape(mconf)
    L = shp.num_layers
    types = cache_types(cfg)
    menu = pair_menu(types)
    # llama.cpp's order of each query/key head: a llama GGUF (or a checkpoint converted to one) interleaves it
    src0 = pre.model.source
    if src0 is not None and getattr(src0, "gguf_file", None):
        head_order = {"architecture": gguf_architecture(Path(src0.path) / src0.gguf_file)}
    else:
        text = pre.model.text_config
        head_order = {"model_type": text.get("model_type") if isinstance(text, dict) else getattr(text, "model_type", None)}
    try:  # a checkpoint whose conversion kvcal has not read: its head order would be a guess
        eng.pair_plan("f16", "f16", L, **head_order)
    except KvcalError as e:
        raise KvcalError(f"--model {cfg.model}: {e}") from None
    try:  # a head_dim a type cannot hold is refused before the model loads
        plans = {(k, v): eng.pair_plan(k, v, L, head_dim=shp.head_dim, **head_order) for k, v in menu}
    except KvcalError as e:
        raise KvcalError(f"--cache-types: {e}") from None
    b16 = eng.pair_bytes_per_token(shp, "f16", "f16")
    tok = tokenizer if tokenizer is not None else load_tokenizer(pre.model.source or cfg.model,
                                                                 vocab_size=pre.model.vocab_size)
    opts = pre.corpus.options
    T = cfg.context
    bos = served_bos(tok)
    ids, info = corpus_stream(cfg.corpus, tok, **opts, checked=True)
    if cfg.eval_corpus is None:
        ev, eval_info = cut_windows(ids, T, max(cfg.windows, cfg.max_windows), bos=bos), info
    else:
        eids, eval_info = corpus_stream(cfg.eval_corpus, tok, **opts, checked=True)
        ev = cut_windows(eids, T, max(cfg.windows, cfg.max_windows), bos=bos)
    if len(ev) == 0:
        src_name = cfg.eval_corpus or cfg.corpus
        raise KvcalError(f"{'--eval-corpus' if cfg.eval_corpus else '--corpus'} {src_name} is shorter than one "
                         f"evaluation window of {T} tokens; lower --context or give a longer corpus")
    src = pre.model.source or resolve_model(cfg.model)
    if model is None:
        model = load_model(src, device=cfg.device)
    serve_model = str(Path(src.path) / src.gguf_file) if src.gguf_file else cfg.model
    accept = cfg.accept or DEFAULT_ACCEPT[PAIR_DEFAULT_BITS]
    crit = parse_accept(accept)
    doc: dict = {}

    def fill(staging: Path):
        # the weights' matmuls as the engine runs them on this GGUF (llama.cpp rounds each matmul's input to the
        # weight type's vec_dot_type): the served KL of a pair includes that re-rounding of every activation a cache
        # error moves, which float32 matmuls would leave out (docs/serving.md, llama.cpp section)
        if src.gguf_file and has(cfg.engine, "MatmulInputs"):
            with eng.MatmulInputs(model, eng.gguf_matmul_inputs(gguf_tensor_types(Path(src.path) / src.gguf_file))) as mm:
                measure(staging, mm)
        else:
            measure(staging, None)

    def measure(staging: Path, mm):
        from tqdm.auto import tqdm

        bar = tqdm(total=0, desc="recommend (windows)", unit="fwd", disable=not progress)

        def tick():
            if bar.n >= bar.total:
                bar.total += 1
            bar.update()

        rows = WindowedRows(model, ev, on_forward=tick)
        n0 = min(cfg.windows, len(ev))
        cap = max(n0, min(cfg.max_windows, len(ev)))
        looks = 1 + max(0, math.ceil(math.log2(cap / n0)))
        pass_level = 1 - (1 - LEVEL) / looks  # Bonferroni over a row's looks, as kvcal recommend --engine vllm
        cands = []
        for k, v in menu:
            nb = eng.pair_bytes_per_token(shp, k, v)
            cands.append({"type_k": k, "type_v": v, "dtype": f"{k}/{v}", "bytes_per_token": nb,
                          "vs_16bit": nb / b16, "criteria": accept, "_plan": plans[(k, v)]})

        def judge_row(i: int, n: int):
            c = cands[i]
            bar.total += max(0, min(n, len(ev)) - rows.measured(i))
            rows.measure(i, c["_plan"], n)
            r = rows.result(i)
            j = judge_bounded(r, crit, level=pass_level, fail_level=LEVEL)
            c.update({m: r[m] for m in ("kl_mean", "kl_p999", "delta_ppl", "ppl", "top1_agree")})
            c.update(windows=r["windows"], status=j["status"], failed=j["failed"], bounds=j["bounds"],
                     windows_needed=j["windows_needed"],
                     per_window={m: r["per_window"][m] for m in ("kl_mean", "nll", "ref_nll")})

        def decide(i: int):
            """Measure row ``i`` on ``n0`` windows, doubling while its bound straddles the bar (up to ``cap``)."""
            n = max(n0, rows.measured(i))
            while True:
                judge_row(i, n)
                if cands[i]["status"] != INCONCLUSIVE or cands[i]["windows"] >= cap:
                    return
                n = min(2 * cands[i]["windows"], cap)

        best = None
        order = sorted(range(len(cands)), key=lambda i: (cands[i]["bytes_per_token"], i))
        for i in order:
            c = cands[i]
            if cfg.max_bytes_per_token is not None and c["bytes_per_token"] > cfg.max_bytes_per_token:
                c.update(status="OVER-BUDGET", failed=[f"bytes_per_token {c['bytes_per_token']} > "
                                                       f"{cfg.max_bytes_per_token}"])
                continue
            if best is not None and c["bytes_per_token"] > cands[best]["bytes_per_token"] and not cfg.measure_all:
                continue
            decide(i)
            if c["status"] == "PASS" and (best is None or (c["bytes_per_token"], c["kl_mean"]) <
                                          (cands[best]["bytes_per_token"], cands[best]["kl_mean"])):
                best = i
        # the folklore pairs, on the chosen row's windows (or the first windows when nothing passed)
        n_common = cands[best]["windows"] if best is not None else n0
        common = []
        for k, v in eng.COMMON_PAIRS:
            if k not in types or v not in types:
                continue
            i = next(j for j, c in enumerate(cands) if (c["type_k"], c["type_v"]) == (k, v))
            if rows.measured(i) < n_common:
                judge_row(i, n_common)
            common.append(i)
        bar.close()
        for c in cands:
            if "status" not in c:
                c.update(status=NOT_MEASURED, failed=["not measured further: a cheaper row passed"
                                                      + (f" ({cands[best]['dtype']})" if best is not None else "")])
        notes = [f"every row: -fa on -ctk K -ctv V as {eng.DISPLAY_NAME} ({eng.VERSION}) writes and reads it "
                 f"(exact ggml block quantizers; the Hadamard rotation of quantized caches "
                 f"{'on' if cands[0]['_plan'].rotation else 'off (LLAMA_ATTN_ROT_DISABLE)'}; queries converted to the "
                 "K type's vec_dot_type), teacher-forced against the model's own unquantized cache on the same "
                 "windows", f"{eng.DISPLAY_NAME} loads no calibrated KV-cache scale (each 32-value block carries an "
                 "fp16 scale computed when it is written): what kvcal calibrates here is the choice of K type and V "
                 "type for this model and corpus, nothing to export",
                 f"bar {accept}{'' if cfg.accept else ' (kvcal evaluate 8-bit bar, every pair)'}: a PASS needs each "
                 f"clause's {pass_level:.2%} Student-t bound inside the bar ({LEVEL:.0%} split over up to {looks} looks "
                 f"per row: {n0} windows, doubled while undecided, at most {cap}), a FAIL the {LEVEL:.0%} opposite "
                 "bound outside it; rows measured cheapest first, none dearer than a PASS"
                 + (" (--measure-all: every row)" if cfg.measure_all else "")]
        if mm is not None:
            kinds = sorted(set(mm.emulated.values()))
            notes.append(f"weight matmuls as {eng.DISPLAY_NAME} runs them on this GGUF: the input of "
                         f"{len(mm.emulated)} matmuls rounded to their weight type's vec_dot_type "
                         f"({', '.join(kinds) or 'none'})"
                         + (f" and GELU through ggml's fp16 table ({len(mm.activations)} layers)" if mm.activations
                            else "") + ", in the reference run and in every pair's"
                         + (f"; {len(mm.left)} not emulated ({', '.join(mm.left[:3])}"
                            f"{', ...' if len(mm.left) > 3 else ''}: a weight type kvcal does not emulate), so "
                            "the figures may understate what the engine serves" if mm.left else ""))
        elif not src.gguf_file:
            notes.append(f"the model is not a GGUF: its weight matmuls run in float32; {eng.DISPLAY_NAME} serving a "
                         "quantized-weight GGUF of it rounds every matmul input and serves larger KLs for the "
                         "high-precision pairs (docs/serving.md)")
        chosen = cands[best] if best is not None else None
        for i in common:
            c = cands[i]
            if chosen is None or c is chosen:
                continue
            more = c["bytes_per_token"] / chosen["bytes_per_token"]
            notes.append(f"vs the common {c['dtype']}: {c['bytes_per_token']} B/token ({more:.2f}x the chosen "
                         f"{chosen['dtype']}'s {chosen['bytes_per_token']}), KL {c['kl_mean']:.3e} vs "
                         f"{chosen['kl_mean']:.3e}, ΔPPL {c['delta_ppl']:+.4f} vs {chosen['delta_ppl']:+.4f} on the same "
                         f"{c['windows']} windows: {c['status']}")
        if chosen is None:
            measured = [c for c in cands if "kl_mean" in c]
            near = min(measured, key=lambda c: ((c["bounds"].get("kl_mean") or {}).get("bound", math.inf),
                                                c["bytes_per_token"]), default=None)
            notes.append("no pair passes the bar" + (
                f"; closest by its KL bound: {near['dtype']} ({near['bytes_per_token']} B/token, KL "
                f"{near['kl_mean']:.3e}, {near['status']}: {'; '.join(near['failed'])})" if near else "")
                + "; -ctk f16 -ctv f16 (the 16-bit cache) is the safe choice")
        else:
            k_only = [c for c in cands if c["type_v"] == "f16" and "kl_mean" in c]
            v_only = [c for c in cands if c["type_k"] == "f16" and "kl_mean" in c]
            if k_only and v_only:
                notes.append("keys and values fail differently: measured with the other side at f16, "
                             + ", ".join(f"K {c['type_k']} KL {c['kl_mean']:.2e}" for c in k_only) + "; "
                             + ", ".join(f"V {c['type_v']} KL {c['kl_mean']:.2e}" for c in v_only))
        commands = None
        if chosen is not None:
            commands = {"export": None, "serve": eng.serve_line(shlex.quote(serve_model), chosen["type_k"],
                                                                chosen["type_v"])}
            if not src.gguf_file:
                notes.append(f"{cfg.model} is not a GGUF file: {eng.DISPLAY_NAME} serves GGUF; convert it "
                             "(llama.cpp's convert_hf_to_gguf.py) and pass that file to -m")
        rot, order = cands[0]["_plan"].rotation, cands[0]["_plan"].kq_interleaved
        for c in cands:
            c.pop("_plan", None)
        used = max((c.get("windows", 0) for c in cands), default=0)
        doc.update({
            "schema": SCHEMA, "menu": "pairs", "engine": cfg.engine, "engine_version": eng.VERSION,
            "model": serve_model, "passed": chosen is not None, "chosen": chosen, "commands": commands,
            "common": [cands[i]["dtype"] for i in common], "cache_types": list(types), "rotation": rot,
            "kq_interleaved": order,
            "matmul_inputs": None if mm is None else {"emulated": len(mm.emulated), "left": list(mm.left)},
            "max_bytes_per_token": cfg.max_bytes_per_token, "bytes_per_token_16bit": b16, "accept": accept,
            "data": {"evaluation": {"corpus": eval_info["path"], "windows": used, "windows_available": len(ev),
                                    "windows_first": n0, "windows_cap": cap, "forward_passes": rows.forwards,
                                    "pass_level": pass_level, "fail_level": LEVEL, "context": T},
                     "bos_token_id": bos, "reference_ppl": rows.reference_ppl(used) if used else None},
            "candidates": cands, "notes": notes})
        (staging / "deploy.json").write_text(json.dumps(doc, indent=2) + "\n")
        (staging / "deploy.md").write_text(render_pairs_markdown(doc))  # kvcal.recommend.render

    write_dir_atomically(Path(cfg.out), fill, overwrite=cfg.overwrite,
                         inputs={"--corpus": cfg.corpus, "--eval-corpus": cfg.eval_corpus}, kind="recommendation")
    return doc

"""What a user deploys is what kvcal measured (issue 38): for every export target, the default export writes the
scale set the search chose and measured for that engine's cache write — read back here from the written files,
independently of kvcal's exporters — on a real calibration of a tiny Llama whose first layers' keys carry large
per-channel offsets (helpers.models.offset_keys), where the search clips some scales."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.models import TINY_LLAMA_16, offset_keys, safetensors_dir, save_tiny_llama

from kvcal.artifact import load_artifact
from kvcal.export import export

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "calibration_sets" / "chat.jsonl"
L = 4


@pytest.fixture(scope="module")
def offset_model(tmp_path_factory, smollm_tokenizer) -> Path:
    cfg = {**TINY_LLAMA_16, "num_hidden_layers": L}
    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-offset-keys", vocab_size=len(smollm_tokenizer),
                        attention_bias=True, **cfg)
    return offset_keys(d, layers=(0, 1))


@pytest.fixture(scope="module")
def offset_artifact(offset_model, tmp_path_factory) -> Path:
    from kvcal.calibrate import CalibrateConfig, calibrate

    out = tmp_path_factory.mktemp("offset-art") / "art"
    calibrate(CalibrateConfig(corpus=str(CHAT), out=str(out), model=str(offset_model), max_samples=12,
                              max_seq_len=96, batch_size=2, reservoir=3, heldout_reservoir=2, max_queries=16),
              log=lambda s: None, progress=False)
    return out


def _recorded(art, which: str) -> dict:
    """layer -> side -> the recorded float32 scale of one set ("searched": the artifact's tensors; "clip_free")."""
    out = {}
    for lm in art.metadata["layers"]:
        i = lm["layer"]
        out[i] = {s: (art.scale(i, s).reshape(-1) if which == "searched" else
                      torch.tensor(lm[s]["clip_free"]["scale"], dtype=torch.float32)) for s in "kv"}
    return out


def test_the_search_clips_here_and_records_both_sets(offset_artifact):
    """The calibration this file's tests stand on: the search clipped at least one scale (so the searched and the
    clip-free sets differ and a raise after the search would show), every clip-free scale covers the recorded
    calibration amax (x 448, float32 rounding: relative 1e-6), and the cache write searched for is recorded."""
    art = load_artifact(offset_artifact)
    assert art.metadata["calibration"]["cache_write"] == "saturating"
    searched, free = _recorded(art, "searched"), _recorded(art, "clip_free")
    clipped = [(i, s) for i in range(L) for s in "kv" if not torch.equal(searched[i][s], free[i][s])]
    assert clipped, "no scale clipped: the tests below would not tell a raised export from the searched one"
    for lm in art.metadata["layers"]:
        for s in "kv":
            assert float(free[lm["layer"]][s].max()) * 448 >= max(lm[s]["amax"]) * (1 - 1e-6)


@pytest.mark.parametrize("target", ["vllm", "modelopt", "trtllm-legacy", "sglang-json"])
def test_default_export_writes_the_measured_set(offset_artifact, offset_model, tmp_path, target):
    """Per target, the default export (no flag) writes exactly the set its manifest names and the search measured:
    the searched scales for the saturating engines' targets (vllm, modelopt: each K and V scale bit for bit;
    trtllm-legacy: max(K, V) per layer, as its one shared scale), the clip-free scales for sglang-json (max(K, V) of
    the clip-free set). The shared targets' cost is the search's measurement at exactly that shared scale
    (layers[i].shared), not an interpolation."""
    art = load_artifact(offset_artifact)
    which = "clip_free" if target == "sglang-json" else "searched"
    rec = _recorded(art, which)
    model_dir = None if target == "trtllm-legacy" else str(offset_model)
    res = export(str(offset_artifact), target, tmp_path / "out", model_dir=model_dir)
    man = json.loads((tmp_path / "out" / "kvcal-export.json").read_text())
    shared = target in ("trtllm-legacy", "sglang-json")
    assert man["scales"] == which + (", as one shared max(K, V) scale per layer" if shared else "")
    assert man["cache_write"] == "saturating"
    if target in ("vllm", "modelopt"):
        t = safetensors_dir(tmp_path / "out")
        fmt = ("model.layers.{i}.self_attn.{s}_scale" if target == "vllm" else
               "model.layers.{i}.self_attn.{s}_proj.{s}_scale")
        for i in range(L):
            for s in "kv":
                assert torch.equal(t[fmt.format(i=i, s=s)].float().reshape(-1), rec[i][s]), (i, s)
        return
    if target == "sglang-json":
        doc = json.loads((tmp_path / "out" / "kv_cache_scales.json").read_text())
        written = [doc["kv_cache"]["scaling_factor"]["0"][str(i)] for i in range(L)]
    else:
        from safetensors.torch import load_file

        t = {}
        for f in (tmp_path / "out").glob("*.safetensors"):
            t.update(load_file(f))
        written = [float(t[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]) for i in range(L)]
    for i in range(L):
        shared = float(torch.maximum(rec[i]["k"], rec[i]["v"]))
        assert written[i] == shared, (i, written[i], shared)
        assert art.metadata["layers"][i]["shared"][which]["scale"] == shared
    rows = man["shared_scale"]
    assert all(r.get("measured", {}).get(s) for r in rows for s in "kv" if r["ratio"][s] > 1 + 1e-5)
    head = next(n for n in res.notes if n.startswith("k/v scales:"))  # the headline: the measured shared figures
    figs = {s: sum(lm["shared"][which]["heldout"][s] for lm in art.metadata["layers"]) / L for s in "kv"}
    assert head.endswith(f"at the shared max(K, V) scale the files hold: K attention KL {figs['k']:.3e}, V output "
                         f"error {figs['v']:.3e})"), head
    assert not any("not measured" in n for n in res.notes + res.warnings)


def test_clip_free_flag_gives_sglang_safe_vllm_checkpoint(offset_artifact, offset_model, tmp_path):
    """--clip-free writes the recorded clip-free set into a vllm checkpoint (bit for bit), reports its measured cost
    against the searched set, and clears the NaN risk the default checkpoint records for SGLang (in
    kvcal-export.json, export's output and kvcal inspect's SGLang row)."""
    art = load_artifact(offset_artifact)
    dflt = export(str(offset_artifact), "vllm", tmp_path / "d", model_dir=str(offset_model))
    assert json.loads((tmp_path / "d" / "kvcal-export.json").read_text())["nan_risk"]["engines"] == ["SGLang"]
    assert any("--clip-free" in n for n in dflt.notes)
    assert not [w for w in dflt.warnings if "without saturating" in w]
    from kvcal.inspect import inspect_path

    sg = inspect_path(tmp_path / "d").engines["SGLang"]  # loaded, and inspect says where it turns into NaN
    assert any("NaN" in n and "--clip-free" in n for n in sg.notes), sg.notes
    res = export(str(offset_artifact), "vllm", tmp_path / "cf", model_dir=str(offset_model), clip_free=True)
    t = safetensors_dir(tmp_path / "cf")
    rec = _recorded(art, "clip_free")
    for i in range(L):
        for s in "kv":
            assert torch.equal(t[f"model.layers.{i}.self_attn.{s}_scale"].float().reshape(-1), rec[i][s])
    man = json.loads((tmp_path / "cf" / "kvcal-export.json").read_text())
    assert man["scales"] == "clip_free" and man["nan_risk"] is None
    assert not any("NaN" in n for n in inspect_path(tmp_path / "cf").engines["SGLang"].notes)
    assert any(n.startswith("clip-free vs searched scales") for n in res.notes)


def test_headroom_prints_its_measured_cost(offset_artifact, tmp_path):
    """--headroom 1.25 changes scales after the search, and export prints what that costs from the calibration-split
    errors the search recorded at exactly those scales (the headroom1.25 candidate): the printed mean relative
    increase per side equals the one recomputed here from layers[i].{k,v}.candidates."""
    import re

    art = load_artifact(offset_artifact)
    res = export(str(offset_artifact), "vllm", tmp_path / "h", headroom=1.25)
    line = next(n for n in res.notes if n.startswith("--headroom cost"))
    assert "measured at the search's candidates of exactly these scales" in line
    incs = {"k": [], "v": []}
    for lm in art.metadata["layers"]:
        for s in "kv":
            c = lm[s]["candidates"]
            own = float(art.scale(lm["layer"], s).reshape(-1)[0])
            if max(lm[s]["amax"]) / 448 * 1.25 > own:  # raised to the headroom1.25 candidate
                e = dict(zip(c["label"], c["calib"], strict=True))
                incs[s].append(e["headroom1.25"] / lm[s]["calib"]["chosen"] - 1)
    for s, word in (("k", "K KL"), ("v", "V output error")):
        if incs[s]:
            m = re.search(word + r" mean ([+-][0-9.]+)%", line)
            assert m and abs(float(m.group(1)) - 100 * sum(incs[s]) / len(incs[s])) <= 0.05 + 1e-9, line


def test_report_states_the_figures_of_each_deployed_set(offset_artifact):
    """report.md's "What is deployed" section names the cache write searched for and, per set, the held-out means
    recomputed here from the per-layer records (searched: layers[i].{k,v}.heldout.chosen; clip-free:
    layers[i].{k,v}.clip_free.heldout), printed to 4 significant digits."""
    art = load_artifact(offset_artifact)
    text = (offset_artifact / "report.md").read_text()
    sec = text[text.index("## What is deployed"):text.index("## Held-out error per layer")]
    assert "**saturating**" in sec
    lay = art.metadata["layers"]
    for which, get in (("searched", lambda r: r["heldout"]["chosen"]), ("clip-free", lambda r: r["clip_free"]["heldout"])):
        k = sum(get(lm["k"]) for lm in lay) / len(lay)
        v = sum(get(lm["v"]) for lm in lay) / len(lay)
        line = next(x for x in sec.splitlines() if f"**{which}**" in x)
        assert f"K attention KL {k:.3e}, V output error {v:.3e}" in line, line


def test_kvcal_report_renders_what_is_deployed(offset_artifact, tmp_path):
    """`kvcal report` (the re-rendered disclosure report) has calibrate's "What is deployed" section: the cache write
    searched for and, per set, the held-out means recomputed here from the per-layer records (4 significant
    digits), in report.md and report.html."""
    from click.testing import CliRunner

    from kvcal.cli import main

    art = load_artifact(offset_artifact)
    r = CliRunner().invoke(main, ["report", "--artifact", str(offset_artifact), "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "rep" / "report.md").read_text()
    start = text.index("## What is deployed")
    sec = text[start:text.index("\n## ", start + 1)]
    assert "**saturating**" in sec
    lay = art.metadata["layers"]
    for which, get in (("searched", lambda r: r["heldout"]["chosen"]), ("clip-free", lambda r: r["clip_free"]["heldout"])):
        k = sum(get(lm["k"]) for lm in lay) / len(lay)
        v = sum(get(lm["v"]) for lm in lay) / len(lay)
        line = next(x for x in sec.splitlines() if f"**{which}**" in x)
        assert f"K attention KL {k:.3e}, V output error {v:.3e}" in line, line
    assert "What is deployed</h2>" in (tmp_path / "rep" / "report.html").read_text()


# ---- kvcal evaluate judges an export: the scales its files hold ------------------------------------------------


@pytest.mark.parametrize("target", ["vllm", "modelopt", "trtllm-legacy", "sglang-json"])
def test_load_deployed_reads_exactly_the_exported_files(offset_artifact, offset_model, tmp_path, target):
    """load_deployed gives, per layer and side, the value in the exported file (read here with safetensors / json
    by the engine's names), the source artifact's model and format, and a `deployed` section naming the target
    and the set written; a hand edit of one exported value is what it then reads (not the artifact's)."""
    from safetensors.torch import load_file, save_file

    from kvcal.artifact.deployed import load_artifact_or_export
    from kvcal.plan import KVPlan

    out = tmp_path / "out"
    export(str(offset_artifact), target, out, model_dir=None if target == "trtllm-legacy" else str(offset_model))
    if target == "sglang-json":
        f = out / "kv_cache_scales.json"
        doc = json.loads(f.read_text())
        per = doc["kv_cache"]["scaling_factor"]["0"]
        want = {(i, s): float(per[str(i)]) for i in range(L) for s in "kv"}
        per["0"] = 0.125  # a hand edit: 2^-3, exact in float32
        f.write_text(json.dumps(doc))
        want[(0, "k")] = want[(0, "v")] = 0.125
    else:
        name = {"vllm": "model.layers.{i}.self_attn.{s}_scale", "modelopt": "model.layers.{i}.self_attn.{s}_proj.{s}_scale",
                "trtllm-legacy": "transformer.layers.{i}.attention.kv_cache_scaling_factor"}[target]
        files = {f: load_file(f) for f in out.glob("*.safetensors")}
        t = {k: v for d in files.values() for k, v in d.items()}
        want = {(i, s): float(t[name.format(i=i, s="k" if target == "trtllm-legacy" else s)]) for i in range(L)
                for s in "kv"}
        first = name.format(i=0, s="k")
        f = next(f for f, d in files.items() if first in d)
        d = dict(files[f])
        d[first] = torch.full_like(d[first], 0.125)
        f.unlink()  # a hard link into the exported copy: replace the file, never write through it
        save_file(d, f, metadata={"format": "pt"})
        want[(0, "k")] = 0.125
        if target == "trtllm-legacy":
            want[(0, "v")] = 0.125
    art = load_artifact_or_export(out)
    plan = KVPlan.from_artifact(art.tensors, art.metadata)
    for i in range(L):
        for s in "kv":
            assert float(art.scale(i, s).reshape(-1)[0]) == want[(i, s)], (i, s)
            assert float(getattr(plan.layers[i], s).scale.reshape(-1)[0]) == want[(i, s)], (i, s)
    dep = art.metadata["deployed"]
    assert dep["target"] == target and dep["scales"] == {
        "sglang-json": "clip_free, as one shared max(K, V) scale per layer",
        "trtllm-legacy": "searched, as one shared max(K, V) scale per layer"}.get(target, "searched")
    assert art.metadata["model"] == load_artifact(offset_artifact).metadata["model"]


def test_load_deployed_refuses_a_missing_or_changed_source_artifact(offset_artifact, tmp_path):
    """An export whose source artifact is gone, or changed after the export (its sha256 differs), is refused in one
    line naming the path and the fix; so is an export directory whose scales were removed."""
    import shutil

    from kvcal.artifact.deployed import load_deployed
    from kvcal.errors import ArtifactError

    src = tmp_path / "art"
    shutil.copytree(offset_artifact, src)
    export(str(src), "vllm", tmp_path / "out")
    (src / "report.md").write_text("edited\n")  # not the scales file: still the same artifact
    load_deployed(tmp_path / "out")
    from helpers.export import make_artifact

    shutil.rmtree(src)
    make_artifact(src)  # another (valid) artifact at the same path
    with pytest.raises(ArtifactError, match="changed after the export") as e:
        load_deployed(tmp_path / "out")
    assert "\n" not in str(e.value)
    shutil.rmtree(src)
    with pytest.raises(ArtifactError, match="is gone") as e:
        load_deployed(tmp_path / "out")
    assert "\n" not in str(e.value) and str(src) in str(e.value)
    shutil.copytree(offset_artifact, src)
    (tmp_path / "out" / "kvcal-kv-scales.safetensors").unlink()
    with pytest.raises(ArtifactError, match="lacks layer 0's k_scale"):
        load_deployed(tmp_path / "out")


def test_evaluate_judges_the_export_as_deployed(offset_artifact, offset_model, tmp_path):
    """kvcal evaluate on the default vllm export measures exactly what it measures on the artifact (the same scales,
    the same arithmetic: equal KL in every row, vLLM's GPU write included), and says it judged the export; on the
    sglang-json export (the clip-free set, differing where the search clipped) the quantized rows differ while the
    baselines in the same run (no scales, absmax) are unchanged."""
    from kvcal.evaluate import EvalConfig, evaluate

    export(str(offset_artifact), "vllm", tmp_path / "v", model_dir=str(offset_model))
    export(str(offset_artifact), "sglang-json", tmp_path / "s")
    docs = {}
    for name, p in (("artifact", offset_artifact), ("vllm", tmp_path / "v"), ("sglang", tmp_path / "s")):
        cfg = EvalConfig(artifact=str(p), corpus=str(CHAT), model=str(offset_model), contexts=(64,), windows=3,
                         modes=("teacher_forced",), per_layer_tokens=0, vllm_dtypes=("fp8",))
        docs[name] = evaluate(cfg, log=lambda s: None, progress=False)
    kl = {n: {r["method"]: r["kl_mean"] for r in d["results"]} for n, d in docs.items()}
    assert kl["vllm"] == kl["artifact"]
    assert kl["sglang"]["artifact"] != kl["artifact"]["artifact"]
    assert kl["sglang"]["vllm:fp8"] != kl["artifact"]["vllm:fp8"]
    for base in ("fp8-unity", "fp8-absmax"):
        assert kl["sglang"][base] == kl["artifact"][base]
    assert docs["vllm"]["artifact"]["deployed"]["target"] == "vllm"
    assert any(n.startswith("judged: the vllm export") for n in docs["vllm"]["notes"])


def test_load_deployed_reads_any_family_names_and_the_checkpoints_q_scale(offset_artifact, tmp_path):
    """Scale names on another family's attention path (GPT-NeoX's `gpt_neox.layers.{i}.attention.k_scale`) are
    read by layer and side; a q_scale the exported checkpoint holds though the artifact has none (kept from
    --model-dir, so vLLM reads it) is read too and said; a q_scale on only some layers, a directory that is neither
    an artifact nor an export, and a manifest without the artifact hash are each named."""
    from safetensors.torch import load_file, save_file

    from kvcal.artifact.deployed import load_artifact_or_export, load_deployed
    from kvcal.errors import ArtifactError

    out = tmp_path / "v"
    export(str(offset_artifact), "vllm", out)
    f = out / "kvcal-kv-scales.safetensors"
    t = load_file(f)
    neox = {k.replace("model.layers.", "gpt_neox.layers.").replace(".self_attn.", ".attention."): v
            for k, v in t.items()}
    neox.update({f"gpt_neox.layers.{i}.attention.q_scale": torch.tensor([0.25 * (i + 1)]) for i in range(L)})
    f.unlink()
    save_file(neox, f, metadata={"format": "pt"})
    art = load_deployed(out)
    for i in range(L):
        for s in "kv":
            assert torch.equal(art.scale(i, s).reshape(-1), t[f"model.layers.{i}.self_attn.{s}_scale"].reshape(-1))
        assert float(art.tensors[f"model.layers.{i}.self_attn.q_scale"].reshape(-1)[0]) == 0.25 * (i + 1)
    assert art.metadata["deployed"]["q_scale_from_checkpoint"] is True
    del neox["gpt_neox.layers.2.attention.q_scale"]
    f.unlink()
    save_file(neox, f, metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="hold a q_scale and 1 others do not"):
        load_deployed(out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="neither a kvcal artifact .* nor a kvcal export"):
        load_artifact_or_export(tmp_path / "empty")
    out2 = tmp_path / "v2"
    export(str(offset_artifact), "vllm", out2)
    man = json.loads((out2 / "kvcal-export.json").read_text())
    del man["artifact_sha256"]  # what an export of an earlier kvcal holds
    (out2 / "kvcal-export.json").write_text(json.dumps(man))
    assert load_deployed(out2).metadata["deployed"]["source_hash_checked"] is False


# ---- forged artifacts (issue 40, class 8): the content hash recomputed by hand -----------------------------------


def test_forged_artifacts_are_refused_by_inspect_export_and_report(offset_artifact, tmp_path):
    """A copy of a real calibration with layer 3's K and V scale tensors swapped, or with model.id pointed at another
    local model (a tiny Llama whose config differs), each with its content hash recomputed as kvcal computes it
    (helpers.export.edited_copy, resign): `kvcal inspect`, `kvcal export` and `kvcal report` exit 2 with one line
    naming the artifact file, the layer and field (layers[3].k.scale / model.id) and the fix (re-run calibrate).
    The unforged artifact's id does name its local model, so that check ran on it and passed."""
    from click.testing import CliRunner
    from helpers.export import edited_copy, make_checkpoint

    from kvcal.artifact.io import _model_config_file
    from kvcal.cli import main

    art = load_artifact(offset_artifact)
    assert _model_config_file(art.metadata["model"]["id"]) is not None  # the id's config is here: checked on load
    k3, v3 = (art.scale(3, s) for s in "kv")
    assert not torch.equal(k3, v3)

    def swap(meta, tensors):
        a, b = "model.layers.3.self_attn.k_scale", "model.layers.3.self_attn.v_scale"
        tensors[a], tensors[b] = tensors[b], tensors[a]

    other = make_checkpoint(tmp_path / "other-model", sharded=False)

    def rename(meta, tensors):
        meta["model"]["id"] = str(other)

    cases = ((swap, "swap", f"tensor model.layers.3.self_attn.k_scale holds [{float(v3)!r}] but metadata field "
                            f"layers[3].k.scale records [{float(k3)!r}]"),
             (rename, "renamed", f"metadata field model.id '{other}' names a model whose config"))
    for edit, name, want in cases:
        forged = edited_copy(offset_artifact, tmp_path / name, edit, resign=True)
        f = forged / "kv_scales.safetensors"
        for args in (["inspect", str(forged)],
                     ["export", "--artifact", str(forged), "--target", "vllm", "--out", str(tmp_path / f"{name}-x")],
                     ["report", "--artifact", str(forged), "--out", str(tmp_path / f"{name}-r")]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 2 and r.output.count("\n") == 1, (args, r.output)
            assert r.output.startswith(f"error: {f}: ") and want in r.output, r.output
            assert "re-run `kvcal calibrate" in r.output
        assert not (tmp_path / f"{name}-x").exists() and not (tmp_path / f"{name}-r").exists()

"""Byte-identity check for the move of every vLLM module into ``kvcal/engines/vllm/`` (issue 41, "One engine, one
room"): run the user paths that touch an engine on a tiny random Llama and record a sha256 of every output.

What runs (all through the CLI, in-process, the way a user runs it; the CLI and Python API are what must not change):

* ``calibrate``: plain fp8 (per tensor, and per head), ``--engine vllm --kv-cache-dtype fp8 --skip-layers auto
  --max-skip 1`` (the per-layer probe), ``--engine vllm --kv-cache-dtype fp8 --backend cpu``, ``--engine vllm
  --kv-cache-dtype nvfp4 --skip-layers 1``;
* ``export`` of those artifacts: ``--target vllm`` (merged into the model), ``modelopt`` (merged), ``sglang-json``
  (``--tp 2``), ``trtllm-legacy``; the vLLM artifacts to ``--target vllm``;
* ``inspect`` of every artifact and export;
* ``evaluate --vllm-dtype fp8,nvfp4 --json`` on the fp8/vLLM artifact and ``--vllm-dtype nvfp4`` on the NVFP4 one,
  ``--backend cpu --vllm-dtype fp8,fp8_e5m2`` on the CPU-backend artifact, and the baselines on the plain one;
* ``report --eval`` on the vLLM fp8 artifact (report.md; report.html's plots are hashed too);
* ``memory`` (``--json``) with ``vllm:<dtype>`` formats (``--skip-layers``, turboquant's boundary layers, a
  sliding-window Gemma 3 config) and a kvcal preset; ``plan --json`` on both configs;
* ``recommend --engine vllm --dtypes fp8,nvfp4,int8_per_token_head --measure-all`` (2 windows of 64 tokens).

What is hashed: each command's exit code and stdout; every file it writes — a ``.safetensors`` file as its tensors
(name, dtype, shape, bytes each) and its header metadata (the ``kvcal`` JSON parsed), a ``.json`` file parsed, any
other file as bytes. Volatile content is removed first and only that: the work directory's and the repository's paths
(replaced by ``<W>``, ``<REPO>``), ISO timestamps (``created``), the durations (``*seconds``, ``*_s``), the ``artifact_sha256`` /
``content_sha256`` / ``artifact.sha256`` of an artifact whose header holds its ``created`` time (and the hash prefix
``kvcal inspect`` prints), and numbers of seconds in stdout. Two runs on the same tree give the same digests (checked when the baseline was taken).

Usage (repository root; ``--out`` a JSON of digests; ``--compare`` an earlier one: prints every difference, exit 1
if any)::

    PYTHONPATH=. HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python diagnostics/engine_move_identity.py \\
        --out /tmp/after.json --compare diagnostics/engine_move_identity.before.json

About 4 minutes on 2 CPU cores (one thread).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "calibration_sets" / "chat.jsonl"
VOLATILE_KEYS = {"created", "seconds", "search_seconds", "artifact_sha256", "content_sha256", "time_s",
                 "engine_start_s", "serve_s", "elapsed_s"}
TS = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[+-]\d{2}:\d{2}|Z)?")
SECONDS = re.compile(r"\b\d+(?:\.\d+)? ?s\b")
SHA = re.compile(r"\b[0-9a-f]{64}\b")


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def scrub(obj, w: str, parent: str = ""):
    """``obj`` (parsed JSON) without volatile keys; strings with the work directory replaced by ``<W>``."""
    if isinstance(obj, dict):
        return {k: scrub(v, w, k) for k, v in obj.items()
                if k not in VOLATILE_KEYS and not k.endswith("seconds") and not (parent == "artifact" and k == "sha256")
                and not (k.endswith("_s") and isinstance(v, (int, float)))}
    if isinstance(obj, list):
        return [scrub(v, w, parent) for v in obj]
    if isinstance(obj, str):
        return TS.sub("<TS>", obj.replace(w, "<W>").replace(str(REPO), "<REPO>"))
    return obj


def scrub_text(text: str, w: str) -> str:
    t = TS.sub("<TS>", text.replace(w, "<W>").replace(str(REPO), "<REPO>"))
    t = re.sub(r"created \S+", "created <TS>", t)
    t = re.sub(r"content_sha256 [0-9a-f]+…", "content_sha256 <HASH>…", t)
    return SECONDS.sub("<S>", t)


def digest_file(p: Path, w: str) -> dict:
    """``{"kind", "sha256", ...}`` of one output file (see the module docstring)."""
    raw = p.read_bytes()
    if p.suffix == ".safetensors":
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__", {}) or {}
        meta = {k: scrub(json.loads(v), w) if k == "kvcal" else v for k, v in meta.items()}
        body = raw[8 + n:]
        tensors = {name: [h["dtype"], h["shape"], sha(body[h["data_offsets"][0]:h["data_offsets"][1]])]
                   for name, h in sorted(header.items())}
        return {"kind": "safetensors", "metadata": sha(json.dumps(meta, sort_keys=True).encode()),
                "tensors": sha(json.dumps(tensors, sort_keys=True).encode()), "n_tensors": len(tensors)}
    if p.suffix == ".json":
        try:
            doc = json.loads(raw)
        except ValueError:
            return {"kind": "bytes", "sha256": sha(raw)}
        return {"kind": "json", "sha256": sha(json.dumps(scrub(doc, w), sort_keys=True).encode())}
    if p.suffix in (".md", ".html", ".txt"):
        return {"kind": "text", "sha256": sha(scrub_text(raw.decode("utf-8"), w).encode())}
    return {"kind": "bytes", "sha256": sha(raw)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file of digests to write")
    ap.add_argument("--compare", default=None, help="an earlier digests JSON: print differences, exit 1 if any")
    ap.add_argument("--keep", default=None, help="keep the work directory here (a new directory)")
    args = ap.parse_args()

    import torch
    from click.testing import CliRunner
    from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    import kvcal
    from kvcal.cli import main as cli
    from kvcal.models import load_tokenizer

    torch.set_num_threads(1)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvcal-identity-"))
    work.mkdir(parents=True, exist_ok=True)
    w = str(work)
    # the tiny Llama the e2e tests build (tests/helpers/models.py: TINY_LLAMA_16 with 4 layers, seed 0)
    tiny = work / "tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=2, tie_word_embeddings=True, vocab_size=49152)).save_pretrained(tiny)
    tok = load_tokenizer("smollm2-135m")
    tok.save_pretrained(tiny)
    tiny32 = work / "tiny32"  # head_dim 32: vLLM's CPU backend needs a multiple of 32 for an FP8 cache
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                 pad_token_id=2, tie_word_embeddings=True, vocab_size=49152)).save_pretrained(tiny32)
    tok.save_pretrained(tiny32)
    gemma = work / "gemma-config"  # a sliding-window config (memory and plan read no weights)
    Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                     max_position_embeddings=256, vocab_size=49152).save_pretrained(gemma)

    cal = ["--model", str(tiny), "--corpus", str(CHAT), "--max-samples", "12", "--max-seq-len", "96", "--quiet"]
    small = ["--batch-size", "2"]
    ev = ["--model", str(tiny), "--corpus", str(CHAT), "--context", "64", "--windows", "2", "--quiet",
          "--accept", "kl_mean<=1"]
    steps: list[tuple[str, list[str]]] = [
        ("cal-fp8", ["calibrate", *cal, "--out", f"{w}/cal-fp8"]),
        ("cal-fp8-head", ["calibrate", *cal, "--granularity", "head", "--out", f"{w}/cal-fp8-head"]),
        ("cal-vllm-fp8", ["calibrate", *cal, *small, "--engine", "vllm", "--kv-cache-dtype", "fp8", "--skip-layers",
                          "auto", "--max-skip", "1", "--probe-tokens", "128", "--out", f"{w}/cal-vllm-fp8"]),
        ("cal-vllm-fp8-cpu", ["calibrate", *cal, "--model", str(tiny32), *small, "--engine", "vllm",
                              "--kv-cache-dtype", "fp8", "--backend", "cpu", "--out", f"{w}/cal-vllm-fp8-cpu"]),
        ("cal-vllm-nvfp4", ["calibrate", *cal, *small, "--engine", "vllm", "--kv-cache-dtype", "nvfp4",
                            "--skip-layers", "1", "--out", f"{w}/cal-vllm-nvfp4"]),
    ]
    for art in ("cal-fp8", "cal-fp8-head", "cal-vllm-fp8", "cal-vllm-fp8-cpu", "cal-vllm-nvfp4"):
        steps.append((f"exp-{art}-vllm", ["export", "--artifact", f"{w}/{art}", "--target", "vllm", "--model-dir",
                                           str(tiny32 if art.endswith("cpu") else tiny), "--out", f"{w}/exp-{art}-vllm"]))
    for target, extra in (("modelopt", ["--model-dir", str(tiny)]), ("sglang-json", ["--tp", "2"]),
                          ("trtllm-legacy", []), ("vllm", [])):
        steps.append((f"exp-cal-fp8-{target}-standalone" if target == "vllm" else f"exp-cal-fp8-{target}",
                      ["export", "--artifact", f"{w}/cal-fp8", "--target", target, *extra, "--out",
                       f"{w}/exp-cal-fp8-{target}" + ("-standalone" if target == "vllm" else "")]))
    steps.append(("exp-cal-fp8-vllm-clip-free", ["export", "--artifact", f"{w}/cal-fp8", "--target", "vllm",
                                                  "--clip-free", "--out", f"{w}/exp-cal-fp8-vllm-clip-free"]))
    steps += [(f"inspect-{name}", ["inspect", argv[argv.index("--out") + 1]]) for name, argv in list(steps)]
    steps += [
        ("eval-vllm-fp8", ["evaluate", "--artifact", f"{w}/cal-vllm-fp8", *ev, "--mode", "teacher_forced",
                           "--no-baselines", "--vllm-dtype", "fp8,nvfp4", "--json", f"{w}/eval-vllm-fp8.json"]),
        ("eval-vllm-nvfp4", ["evaluate", "--artifact", f"{w}/cal-vllm-nvfp4", *ev, "--mode", "teacher_forced",
                             "--no-baselines", "--vllm-dtype", "nvfp4", "--json", f"{w}/eval-vllm-nvfp4.json"]),
        ("eval-vllm-cpu", ["evaluate", "--artifact", f"{w}/cal-vllm-fp8-cpu", *ev, "--model", str(tiny32), "--mode",
                           "teacher_forced",
                           "--no-baselines", "--backend", "cpu", "--vllm-dtype", "fp8,fp8_e5m2", "--json",
                           f"{w}/eval-vllm-cpu.json"]),
        ("eval-fp8-baselines", ["evaluate", "--artifact", f"{w}/cal-fp8", *ev, "--vllm-dtype",
                                "fp8_per_token_head,int4_per_token_head,turboquant_4bit_nc", "--json",
                                f"{w}/eval-fp8-baselines.json"]),
        ("eval-export-vllm", ["evaluate", "--artifact", f"{w}/exp-cal-vllm-fp8-vllm", *ev, "--mode", "teacher_forced",
                              "--no-baselines", "--vllm-dtype", "fp8", "--json", f"{w}/eval-export-vllm.json"]),
        ("report-vllm-fp8", ["report", "--artifact", f"{w}/cal-vllm-fp8", "--eval", f"{w}/eval-vllm-fp8.json"]),
        ("report-vllm-nvfp4", ["report", "--artifact", f"{w}/cal-vllm-nvfp4", "--eval", f"{w}/eval-vllm-nvfp4.json"]),
    ]
    for model, tag in ((str(tiny), "tiny"), (str(gemma), "gemma")):
        for fmt, extra in (("vllm:fp8", []), ("vllm:nvfp4", ["--skip-layers", "0"]), ("vllm:turboquant_4bit_nc", []),
                           ("vllm:int4_per_token_head", []), ("fp8", []), ("int4", [])):
            steps.append((f"memory-{tag}-{fmt}", ["memory", "--model", model, "--format", fmt, "--context", "200",
                                                   "--batch", "3", *extra, "--json"]))
            steps.append((f"memory-{tag}-{fmt}-text", ["memory", "--model", model, "--format", fmt, "--context",
                                                        "200", *extra]))
        steps.append((f"plan-{tag}", ["plan", "--model", model, "--gpu-mem", "1GiB", "--json"]))
        steps.append((f"plan-{tag}-text", ["plan", "--model", model, "--gpu-mem", "1GiB"]))
    steps.append(("memory-embedded-vllm-fp8", ["memory", "--format", "vllm:fp8", "--json"]))
    steps.append(("recommend", ["recommend", "--engine", "vllm", "--model", str(tiny), "--corpus", str(CHAT),
                                "--out", f"{w}/rec", "--dtypes", "fp8,nvfp4,int8_per_token_head", "--context", "64",
                                "--windows", "2", "--max-windows", "2", "--probe-tokens", "64", "--measure-all",
                                "--accept", "kl_mean<=1", "--max-skip", "1", "--quiet"]))
    steps.append(("inspect-rec", ["inspect", f"{w}/rec/artifact-nvfp4"]))

    out: dict = {"kvcal": str(Path(kvcal.__file__).parent.relative_to(REPO.parent)) if
                 Path(kvcal.__file__).is_relative_to(REPO.parent) else kvcal.__file__, "steps": {}, "files": {}}
    runner = CliRunner()
    for name, argv in steps:
        r = runner.invoke(cli, argv, catch_exceptions=True)
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            import traceback

            traceback.print_exception(r.exception)
        out["steps"][name] = {"exit": r.exit_code, "stdout": sha(scrub_text(r.output, w).encode()),
                              "argv": [a.replace(w, "<W>").replace(str(REPO), "<REPO>") for a in argv]}
        print(f"{name}: exit {r.exit_code}", file=sys.stderr, flush=True)
    for p in sorted(work.rglob("*")):
        rel = str(p.relative_to(work))
        if p.is_file() and not rel.startswith(("tiny/", "tiny32/", "gemma-config/")):
            out["files"][rel] = digest_file(p, w)
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{len(out['steps'])} commands, {len(out['files'])} files -> {args.out}", file=sys.stderr)
    if args.compare:
        ref = json.loads(Path(args.compare).read_text(encoding="utf-8"))
        diffs = []
        for part in ("steps", "files"):
            for k in sorted(set(ref[part]) | set(out[part])):
                a, b = ref[part].get(k), out[part].get(k)
                if a != b:
                    diffs.append(f"{part}/{k}: {a} != {b}")
        n = len(out["steps"]) + len(out["files"])
        print(f"compared {len(out['steps'])} commands (exit code + stdout) and {len(out['files'])} files with "
              f"{args.compare}: {'all equal' if not diffs else f'{len(diffs)} of {n} differ'}")
        for d in diffs:
            print("  " + d)
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A vLLM KV dtype the model's head_dim cannot store (nvfp4 packs 16-channel blocks: head_dim a multiple of 16;
turboquant rotates by a Hadamard matrix: a power of two) is refused on a head_dim-8 model by ``kvcal calibrate
--engine vllm --kv-cache-dtype nvfp4``, ``kvcal recommend`` and ``kvcal evaluate --vllm-dtype nvfp4`` with one
``error:`` line before the model loads, nothing written (never a ``VllmDTypeError`` traceback mid-search);
``kvcal memory --format vllm:nvfp4`` refuses it rather than printing a size without block scales; and the
default menu of ``recommend`` leaves such a dtype out with a note."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.models import TINY_LLAMA_8, save_tiny_llama

from kvcal.cli import main
from kvcal.errors import KvcalError

CHAT = Path(__file__).resolve().parents[2] / "calibration_sets" / "chat.jsonl"


@pytest.mark.parametrize("name, ok, bad", [("nvfp4", (16, 64, 80, 96, 128), (8, 24, 72)),
                                          ("nvfp4_4over6", (16, 128), (8,)),
                                          ("turboquant_4bit_nc", (8, 16, 64, 128), (24, 80, 96)),
                                          ("fp8", (8, 24, 80, 96), ())])
def test_check_head_dim(name, ok, bad):
    """nvfp4*: multiples of 16 pass; turboquant_*: powers of two pass; fp8 takes any head_dim. A refusal names
    the dtype and the head_dim; head_slot_bytes refuses the same (nvfp4 at D=8 used to give 2·(4 + 0) = 8 per
    head, no block scale)."""
    from kvcal.engines.vllm.dtypes import VllmDTypeError, check_head_dim, head_slot_bytes

    for d in ok:
        check_head_dim(name, d)
        head_slot_bytes(name, d)
    for d in bad:
        with pytest.raises(VllmDTypeError, match=f"{name} needs .* this model's is {d}"):
            check_head_dim(name, d)
        with pytest.raises(VllmDTypeError):
            head_slot_bytes(name, d)


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory, smollm_tokenizer):
    """TINY_LLAMA_8: 2 layers, 2 KV heads x head_dim 8 (32 hidden / 4 heads), with an FP8 artifact for it."""
    from helpers.cli import fp8_artifact

    d = save_tiny_llama(tmp_path_factory, smollm_tokenizer, "tiny-llama-hd8", vocab_size=49152, **TINY_LLAMA_8)
    return d, fp8_artifact(tmp_path_factory.mktemp("hd8-art"), d)


@pytest.mark.parametrize("command", ["calibrate", "recommend", "evaluate"])
def test_nvfp4_on_head_dim_8_is_one_line_before_the_model_loads(tiny8, no_model, tmp_path, command):
    """calibrate --kv-cache-dtype nvfp4 / recommend --dtypes nvfp4,fp8 / evaluate --vllm-dtype nvfp4 on head_dim 8:
    exit 2, one error line naming the dtype, head_dim 8 and the fix; loader never reached, nothing written."""
    model, art = tiny8
    out = tmp_path / "out"
    args, fix = {
        "calibrate": (["calibrate", "--engine", "vllm", "--kv-cache-dtype", "nvfp4", "--max-seq-len", "64"],
                      "; choose fp8"),
        "recommend": (["recommend", "--engine", "vllm", "--dtypes", "nvfp4,fp8"], "; pass --dtypes fp8"),
        "evaluate": (["evaluate", "--artifact", str(art), "--vllm-dtype", "nvfp4", "--context", "16", "--json"],
                     "; drop it from --vllm-dtype"),
    }[command]
    args = [*args, str(out)] if command == "evaluate" else [*args, "--out", str(out)]
    r = CliRunner().invoke(main, [*args, "--model", str(model), "--corpus", str(CHAT), "--quiet"])
    assert r.exit_code == 2, (r.output, r.exception)
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in r.output
    assert line.startswith("error: ") and "nvfp4 needs head_dim a multiple of 16 (NVFP4 blocks), this model's is 8" \
        in line and line.endswith(fix), line
    assert no_model == [] and not out.exists()


def test_memory_refuses_nvfp4_on_head_dim_8(tiny8):
    """kvcal memory --format vllm:nvfp4 on head_dim 8 is refused in one error line (no size without block scales)."""
    r = CliRunner().invoke(main, ["memory", "--model", str(tiny8[0]), "--format", "vllm:nvfp4"])
    assert r.exit_code == 2 and r.output.strip() == (
        "error: nvfp4 needs head_dim a multiple of 16 (NVFP4 blocks), this model's is 8"), r.output


def test_recommend_default_menu_leaves_out_what_the_head_dim_cannot_hold():
    """The default menu on head_dim 8 keeps every dtype but nvfp4 (8 is a power of two: turboquant stays), with
    a note naming it; on head_dim 96 it also leaves out the four turboquant presets; an explicit menu of only
    such dtypes is refused."""
    from types import SimpleNamespace

    from kvcal.recommend import DEFAULT_MENU, RecommendConfig, check_head_dims

    def conf(d):
        return SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                               hidden_size=2 * d, head_dim=d)

    cfg = RecommendConfig(corpus="c.jsonl", out="o")
    menu, notes = check_head_dims(cfg, conf(8))
    assert menu == tuple(d for d in DEFAULT_MENU if d != "nvfp4")
    assert notes == ["nvfp4 left out of the default menu: nvfp4 needs head_dim a multiple of 16 (NVFP4 blocks), "
                     "this model's is 8"]
    menu, notes = check_head_dims(cfg, conf(96))
    assert menu == tuple(d for d in DEFAULT_MENU if not d.startswith("turboquant_")) and len(notes) == 4
    assert check_head_dims(cfg, conf(128)) == (DEFAULT_MENU, [])
    with pytest.raises(KvcalError, match="^--dtypes nvfp4: .*; choose another --dtypes$"):
        check_head_dims(RecommendConfig(corpus="c.jsonl", out="o", dtypes=("nvfp4",)), conf(8))

"""Windows start with BOS where the tokenizer adds one (as the model is served), and only there."""

from __future__ import annotations

import pytest
import torch
from helpers.models import save_tiny_gemma3

from kvcal.corpus import load_corpus
from kvcal.evaluate.windows import cut_windows, served_bos


def test_cut_windows_with_bos_by_hand():
    """cut_windows on tokens 5..19, worked by hand: with a BOS id each 4-token window is BOS followed by the next 3
    stream tokens (the stream advances 3 per window), skip counts such 3-token steps and a request for more windows than
    fit returns those that fit; without BOS the plain consecutive 4-token cut is unchanged; a 1-token window with BOS is
    a ValueError."""
    ids = torch.arange(5, 20)
    assert cut_windows(ids, 4, 3, bos=1).tolist() == [[1, 5, 6, 7], [1, 8, 9, 10], [1, 11, 12, 13]]
    assert cut_windows(ids, 4, 9, skip=3, bos=1).tolist() == [[1, 14, 15, 16], [1, 17, 18, 19]]
    assert cut_windows(ids, 4, 2).tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]  # no BOS: unchanged
    with pytest.raises(ValueError, match="at least 2"):
        cut_windows(ids, 1, 2, bos=1)


@pytest.fixture(scope="module")
def bos_tok(tmp_path_factory, smollm_tokenizer):
    from kvcal.models import load_tokenizer

    return load_tokenizer(str(save_tiny_gemma3(tmp_path_factory, smollm_tokenizer, "g3-bos")))


def test_served_bos(smollm_tokenizer, bos_tok):
    """SmolLM2's tokenizer adds no BOS: its windows stay the prior-art protocol's, byte for byte."""
    assert served_bos(smollm_tokenizer) is None
    assert served_bos(bos_tok) == 1
    ids = torch.arange(100)
    assert torch.equal(cut_windows(ids, 16, 4, bos=served_bos(smollm_tokenizer)), ids[:64].view(4, 16))


def test_txt_calibration_windows_start_with_bos(tmp_path, smollm_tokenizer, bos_tok):
    """A .txt document longer than max_seq_len: with the BOS tokenizer every window starts with BOS (the first
    the document's own, later ones prepended) and the windows without it are the document's tokens in order;
    SmolLM2's windows are the plain consecutive cut."""
    text = " ".join(f"word{i}" for i in range(60))
    f = tmp_path / "d.txt"
    f.write_text(text + "\n", encoding="utf-8")
    doc = bos_tok(text).input_ids  # the reader keeps the document without its final line break
    assert doc[0] == 1
    c = load_corpus(str(f), bos_tok, max_seq_len=8)
    samples = [s.tolist() for s in c.samples]
    assert all(s[0] == 1 for s in samples) and all(len(s) <= 8 for s in samples)
    assert samples[0] + [t for s in samples[1:] for t in s[1:]] == doc
    plain = [s.tolist() for s in load_corpus(str(f), smollm_tokenizer, max_seq_len=8).samples]
    want = smollm_tokenizer(text).input_ids
    assert [t for s in plain for t in s] == want and all(len(s) == 8 for s in plain[:-1])

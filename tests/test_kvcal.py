"""kvcal's parts on their own: fp8 rounding as engines store a KV cache, the scale rule, the
calibration text, and the reference's chunked prefill reading its own cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from qwen_kvprep.errors import UsageError
from qwen_kvprep.kvcal import fp8, reference, text
from qwen_kvprep.kvjudge.passage import PASSAGE
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.convert_kit import converted
from tests.remote_code import transformers_release


def _needs_fp8() -> None:
    if not fp8.has_fp8():
        needs.skip("torch-float8", f"torch {torch.__version__} has no float8_e4m3fn")


def test_roundtrip_saturates_at_448_times_the_scale_instead_of_giving_nan() -> None:
    _needs_fp8()
    x = torch.tensor([0.0, 1.0, -3.5, 448.0, 449.0, 1e6, -1e6])
    got = fp8.roundtrip(x, 1.0)
    assert got.tolist() == [0.0, 1.0, -3.5, 448.0, 448.0, 448.0, -448.0]
    assert fp8.roundtrip(x * 4096, 4096.0).tolist() == [v * 4096 for v in got.tolist()]


def test_the_scale_is_absmax_over_448_in_float32() -> None:
    assert fp8.scale_of(448.0) == 1.0 and fp8.scale_of(43677.984375) == pytest.approx(
        43677.984375 / 448, rel=1e-7)
    assert fp8.scale_of(0.0) == fp8.MIN_SCALE
    with pytest.raises(ValueError):
        fp8.scale_of(float("nan"))


def test_the_default_calibration_is_the_corpus_cut_at_its_token_count(tmp_path: Path) -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "calibration tokenizes with the converted tokenizer, "
                   "which the tokenizers of transformers 4.37 on read")
    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", shards=1)
    tok = text.tokenizer_of(ckpt)  # DIR's qwen.tiktoken, before OUT exists
    a, b = text.default_calibration(tok), text.default_calibration(tok)
    assert a == b and len(a.tokens) == text.CALIBRATION_TOKENS
    assert [len(r) for r in a.rows()] == [text.ROW_TOKENS] * (
        text.CALIBRATION_TOKENS // text.ROW_TOKENS)
    path = tmp_path / "mine.txt"
    path.write_bytes(PASSAGE.encode() * 3)
    mine = text.calibration(tok, path)
    assert mine.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert mine.name == str(path) and len(mine.tokens) >= text.MIN_TOKENS
    path.write_bytes(PASSAGE.encode() * 200)
    assert len(text.calibration(tok, path).tokens) == text.MAX_TOKENS
    path.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(UsageError, match="not UTF-8"):
        text.calibration(tok, path)
    with pytest.raises(UsageError, match="no such file"):
        text.calibration(tok, tmp_path / "absent.txt")


@pytest.mark.usefixtures("isolated_hf")
def test_chunked_prefill_reads_its_own_cache(tmp_path: Path) -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    out = converted(generate_checkpoint(tmp_path / "Tiny-Chat", shards=1), tmp_path / "out")
    ids = text.passage_ids(text.tokenizer_of(out), 200)
    model = reference._load(out)
    whole = reference.topk_logprobs(out, ids, chunk=64, model=model)
    small = reference.topk_logprobs(out, ids, chunk=7, model=model)
    assert len(whole) == len(small) == 199
    for a, b in zip(whole, small):  # the same distributions, read 7 tokens at a time
        common = set(a) & set(b)
        assert len(common) >= len(a) - 1  # a near tie at the 20th place may swap
        assert max(abs(a[t] - b[t]) for t in common) < 1e-4
    with pytest.raises(ValueError, match="no k_scale"):
        reference.topk_logprobs(out, ids, reference.CacheMode("fp8_e4m3"), model=model)
    with pytest.raises(ValueError, match="chunk"):
        reference.topk_logprobs(out, ids, chunk=65, model=model)


def test_the_scored_passage_is_not_the_default_calibration_text() -> None:
    # scored on the text it was calibrated on, a cache would be judged in-sample
    from qwen_kvprep.convert import corpus
    from qwen_kvprep.kvjudge.passage import PASSAGE

    calibration = "\n".join(corpus.texts())
    pieces = [line[:40] for line in PASSAGE.splitlines() if len(line) >= 40]
    assert pieces and not [p for p in pieces if p in calibration]

"""`smoke DIR` on a fixed folder scores a passage through Qwen's own Int8 cache by the
numbers the engine smoke's KV table gives vLLM's caches (kvjudge): the child's reading of
the passage on the tiny checkpoint's remote code, and the parent's judgement of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.kvjudge import verdict
from qwen_kvprep.smoke.kvtable import judge_passage
from qwen_kvprep.smoke.protocol import KvPassage
from qwen_kvprep.tiny import generate_checkpoint
from tests.remote_code import with_compat


def _passage(shift: float) -> KvPassage:
    ref = [{"1": -0.2, "2": -2.0, "3": -3.0} for _ in range(450)]
    test = [{"1": -0.2 - shift, "2": -2.0 + shift, "3": -3.0} for _ in range(450)]
    return {"tokens": 451, "chunk": 32, "quantized": test, "unquantized": ref}


def test_the_int8_cache_is_judged_by_the_kv_tables_numbers_and_thresholds() -> None:
    good, row = judge_passage(_passage(0.01))
    assert good.severity.value == "ok" and row["usable"] and row["tokens_scored"] == 450
    assert row["top1_agree"] == 1.0 and 0 < (row["kl_mean"] or 0) <= verdict.MAX_KL_MEAN
    assert "kl_mean" in good.message and "top1_agree 1.000" in good.message
    bad, row = judge_passage(_passage(2.0))  # token 2 overtakes token 1 everywhere
    assert bad.severity.value == "warn" and not row["usable"] and row["top1_agree"] == 0.0
    assert "not usable" in bad.message
    broken, row = judge_passage({**_passage(0.0), "quantized": []})
    assert broken.severity.value == "warn" and row["tokens_scored"] == 0


@pytest.mark.slow
def test_the_passage_is_read_through_the_models_own_int8_cache(tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from qwen_kvprep.smoke.kvscore import measure_passage

    ckpt = generate_checkpoint(tmp_path / "tiny", layers=2, heads=2, head_dim=32,
                               intermediate=64, dtype="fp32", shards=1,
                               config_overrides={"seq_length": 512})
    with_compat(ckpt)
    config: Any = AutoConfig.from_pretrained(str(ckpt), trust_remote_code=True)
    config.use_cache_quantization, config.use_cache_kernel = True, False
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), config=config,
                                                 trust_remote_code=True,
                                                 torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt), trust_remote_code=True)
    passage = measure_passage(model, tokenizer)
    assert passage["tokens"] == 511 and passage["chunk"] <= 64
    assert len(passage["quantized"]) == len(passage["unquantized"]) == 510
    # the Int8 cache moves the numbers (it quantizes), by little (it holds what was written)
    assert passage["quantized"] != passage["unquantized"]
    finding, row = judge_passage(passage)
    assert row["tokens_scored"] == 510 and row["kl_mean"] is not None
    assert row["usable"], finding.message
    # the flag is as it was: the measurement switched it on and off, then restored it
    assert model.config.use_cache_quantization is True

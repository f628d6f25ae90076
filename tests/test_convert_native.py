"""The real proof, quick: OUT loads with transformers' own Qwen2ForCausalLM (no remote code)
and gives the original's logits and greedy tokens, the original loaded through its remote
code (with qwen-kvprep's compatibility module on a scratch copy, which the newest
transformers needs). The full verification child is convert.verify's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from qwen_kvprep.convert.run import ConvertOptions, convert
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.remote_code import transformers_release, with_compat


def _models(tmp_path: Path, **kw: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", **kw)  # type: ignore[arg-type]
    out = tmp_path / "qwen2"
    convert(ckpt, out, ConvertOptions(verify=False))
    scratch = tmp_path / "Tiny-Scratch"
    shutil.copytree(ckpt, scratch)
    with_compat(scratch)
    original = AutoModelForCausalLM.from_pretrained(str(scratch), trust_remote_code=True)
    native = Qwen2ForCausalLM.from_pretrained(str(out))
    return original.eval(), native.eval()


def _prompts() -> torch.Tensor:
    return torch.randint(0, 500, (3, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.usefixtures("isolated_hf")
def test_fp32_logits_and_greedy_tokens_equal(tmp_path: Path) -> None:
    original, native = _models(tmp_path, dtype="fp32", shards=2)
    assert native.dtype == torch.float32
    ids = _prompts()
    with torch.no_grad():
        a, b = original(ids).logits, native(ids).logits
    assert (a - b).abs().max().item() <= 1e-4
    g1 = original.generate(ids[:1, :8], max_new_tokens=24, do_sample=False)
    g2 = native.generate(ids[:1, :8], max_new_tokens=24, do_sample=False)
    assert torch.equal(g1, g2)


@pytest.mark.slow
@pytest.mark.usefixtures("isolated_hf")
def test_bf16_greedy_tokens_equal(tmp_path: Path) -> None:
    original, native = _models(tmp_path, dtype="bf16", shards=1)
    assert native.dtype == original.dtype == torch.bfloat16
    ids = _prompts()
    with torch.no_grad():
        a, b = original(ids).logits.float(), native(ids).logits.float()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max().item() < 0.5  # bf16 rounding in another order of operations


@pytest.mark.slow
@pytest.mark.usefixtures("isolated_hf")
def test_convert_proves_by_default(tmp_path: Path) -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", dtype="fp32", shards=2)
    result = convert(ckpt, tmp_path / "qwen2", ConvertOptions(verify_timeout=600))
    assert result.verify is not None and result.verify.ok, result.verify.lines
    assert any("greedy" in line for line in result.verify.lines)
    assert result.serving and any("vllm serve" in cmd for _e, cmd in result.serving)

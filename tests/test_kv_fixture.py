"""The fixture whose K and V run past fp8 e4m3's range keeps the model's function."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.convert_kit import converted
from tests.kv_fixture import push_kv_out_of_fp8_range
from tests.remote_code import transformers_release

FP8_E4M3_MAX = 448.0


def _run(ckpt: Path, ids: torch.Tensor, tmp: Path) -> tuple[torch.Tensor, float]:
    """The checkpoint's float32 logits, read through its conversion (proven equal to it, and
    loadable without remote code on every release from 4.37), and the largest |K| or |V|
    its k_proj and v_proj give (before rotary, which only turns pairs of K's channels)."""
    from transformers import Qwen2ForCausalLM

    out = converted(ckpt, tmp / f"{ckpt.name}-qwen2")
    kwarg = "dtype" if transformers_release() >= (4, 56) else "torch_dtype"
    model = Qwen2ForCausalLM.from_pretrained(str(out), **{kwarg: torch.float32}).eval()
    seen: list[float] = []

    def hook(_m: torch.nn.Module, _i: object, got: torch.Tensor) -> None:
        seen.append(float(got.abs().max()))

    hooks = [m.register_forward_hook(hook) for n, m in model.named_modules()
             if n.endswith(("self_attn.k_proj", "self_attn.v_proj"))]
    with torch.no_grad():
        logits = model(ids).logits.float()
    for h in hooks:
        h.remove()
    return logits, max(seen)


def test_same_logits_with_kv_past_fp8_range(tmp_path: Path) -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")
    plain = generate_checkpoint(tmp_path / "Tiny-Chat", shards=2)
    pushed = tmp_path / "Tiny-Pushed"
    shutil.copytree(plain, pushed)
    push_kv_out_of_fp8_range(pushed)
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    a, kv_a = _run(plain, ids, tmp_path)
    b, kv_b = _run(pushed, ids, tmp_path)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert kv_a < FP8_E4M3_MAX < kv_b
    assert kv_b == pytest.approx(kv_a * 2 ** 12, rel=1e-3)


def test_refuses_gptq(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "Tiny-Int4", gptq=True, shards=1)
    with pytest.raises(ValueError, match="GPTQ"):
        push_kv_out_of_fp8_range(ckpt)

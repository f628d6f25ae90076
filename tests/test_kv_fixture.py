"""The fixture whose K and V run past fp8 e4m3's range keeps the model's function."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from qwen_kvprep.tiny import generate_checkpoint
from tests.kv_fixture import push_kv_out_of_fp8_range
from tests.remote_code import with_compat

FP8_E4M3_MAX = 448.0


def _run(ckpt: Path, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The original's float32 logits through its remote code, and the largest |K| or |V|
    its c_attn gives (before rotary, which only turns pairs of K's channels)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), trust_remote_code=True, torch_dtype=torch.float32
    ).eval()
    seen: list[float] = []

    def hook(_m: torch.nn.Module, _i: object, out: torch.Tensor) -> None:
        third = out.shape[-1] // 3
        seen.append(float(out[..., third:].abs().max()))

    hooks = [m.register_forward_hook(hook) for n, m in model.named_modules()
             if n.endswith("attn.c_attn")]
    with torch.no_grad():
        logits = model(ids).logits.float()
    for h in hooks:
        h.remove()
    return logits, max(seen)


@pytest.mark.usefixtures("isolated_hf")
def test_same_logits_with_kv_past_fp8_range(tmp_path: Path) -> None:
    plain = generate_checkpoint(tmp_path / "Tiny-Chat", shards=2)
    pushed = tmp_path / "Tiny-Pushed"
    shutil.copytree(plain, pushed)
    push_kv_out_of_fp8_range(pushed)
    for folder in (plain, pushed):
        with_compat(folder)
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(3))
    a, kv_a = _run(plain, ids)
    b, kv_b = _run(pushed, ids)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert kv_a < FP8_E4M3_MAX < kv_b
    assert kv_b == pytest.approx(kv_a * 2 ** 12, rel=1e-3)


def test_refuses_gptq(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "Tiny-Int4", gptq=True, shards=1)
    with pytest.raises(ValueError, match="GPTQ"):
        push_kv_out_of_fp8_range(ckpt)

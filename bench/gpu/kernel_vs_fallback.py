"""Greedy tokens through our kernel equal the model's own fallback's, on a fixed checkpoint;
and, where fix installed qwen-kvprep's fast path, the fast path's equal the model's own
quantized-cache code with the same kernel.

    python bench/gpu/kernel_vs_fallback.py DIR [--device cuda] [--tokens N] [--json FILE]

DIR is a checkpoint `qwen-kvprep fix` prepared (Int8 cache and kernel on in config.json).
The model is loaded once, as a server would (from_pretrained, trust_remote_code); it
generates N greedy tokens for a small batch of prompts with every attention layer on the
compiled extension, then again with each layer's `cache_kernels` set to None, which is the
remote code's own fallback (dequantize, then torch.matmul). Both runs use the quantized
cache; only the two matrix products differ. Reports the tokens of both, where they first
differ, the largest logit difference while they agree, and how many layers called the
extension. With the fast path installed (qwen_kvprep_kv.py), a third run switches it off
in every layer (the model's own code with the kernel): its tokens must equal the fast
path's, and every layer must have run the fast path. Exit status 1 when the tokens differ
or a layer did not use the kernel (or the installed fast path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch


def attention_layers(model: Any) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "cache_kernels")]


def greedy(model: Any, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    past = None
    cur = ids
    out, logits = [], []
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=cur, past_key_values=past, use_cache=True)
            step = res.logits[:, -1, :].float()
            nxt = step.argmax(dim=-1, keepdim=True)
            logits.append(step)
            out.append(nxt)
            past = res.past_key_values
            cur = nxt
    return torch.cat(out, dim=1), logits


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(args.dir), trust_remote_code=True)
    model = model.to(args.device).eval()
    layers = attention_layers(model)
    ext = next((m.cache_kernels for m in layers if m.cache_kernels is not None), None)
    calls = {"n": 0, "layers": set()}
    if ext is not None:
        for layer in layers:
            real = layer.cache_kernels

            class Counting:
                def __init__(self, inner: Any, owner: int) -> None:
                    self.inner, self.owner = inner, owner

                def __getattr__(self, name: str) -> Any:
                    fn = getattr(self.inner, name)

                    def wrapped(*a: Any, **k: Any) -> Any:
                        calls["n"] += 1
                        calls["layers"].add(self.owner)  # type: ignore[attr-defined]
                        return fn(*a, **k)

                    return wrapped

            layer.cache_kernels = Counting(real, id(layer))
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, min(vocab, 500), (3, 24), generator=g).to(args.device)
    fast_installed = bool(layers) and bool(getattr(type(layers[0]), "_qwen_kvprep_fast", False))
    for m in layers:
        m.qwen_kvprep_fast_steps = 0
    with_kernel, logits_k = greedy(model, ids, args.tokens)
    fast_layers = sum(1 for m in layers if getattr(m, "qwen_kvprep_fast_steps", 0))
    own = None
    if fast_installed:
        for m in layers:
            m.qwen_kvprep_fast_off = True
        own, logits_o = greedy(model, ids, args.tokens)
        for m in layers:
            m.qwen_kvprep_fast_off = False
    saved = [m.cache_kernels for m in layers]
    for m in layers:
        m.cache_kernels = None
    fallback, logits_f = greedy(model, ids, args.tokens)
    for m, s in zip(layers, saved):
        m.cache_kernels = s
    same = bool(torch.equal(with_kernel, fallback))
    diff_at = None
    if not same:
        cols = (with_kernel != fallback).any(dim=0).nonzero()
        diff_at = int(cols[0].item())
    upto = diff_at if diff_at is not None else args.tokens
    max_diff = max(
        ((a - b).abs().max().item() for a, b in zip(logits_k[: upto + 1], logits_f[: upto + 1])),
        default=0.0,
    )
    spread = max((x.max() - x.min()).item() for x in logits_f[: upto + 1])
    fast: dict[str, Any] = {"installed": fast_installed, "fast_layers": fast_layers}
    if own is not None:
        fast["identical_to_own_code"] = bool(torch.equal(with_kernel, own))
        fast["max_abs_logit_diff_to_own_code"] = max(
            ((a - b).abs().max().item() for a, b in zip(logits_k, logits_o)), default=0.0
        )
    result = {
        "fast_path": fast,
        "layers": len(layers),
        "kernel_layers": len(calls["layers"]),  # type: ignore[arg-type]
        "kernel_calls": calls["n"],
        "tokens": args.tokens,
        "batch": int(ids.shape[0]),
        "identical": same,
        "first_difference": diff_at,
        "max_abs_logit_diff": max_diff,
        "logit_range": spread,
        "with_kernel": with_kernel.tolist(),
        "fallback": fallback.tolist(),
        "device": args.device,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("with_kernel", "fallback")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = same and result["kernel_layers"] == len(layers) and len(layers) > 0
    if fast_installed:
        ok = ok and fast_layers == len(layers) and bool(fast.get("identical_to_own_code"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

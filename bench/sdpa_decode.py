"""How fast is one decode step of the unquantized cache's attention, per SDPA backend?

Qwen (v1) remote code, with the unquantized cache and flash-attn off, calls
torch.nn.functional.scaled_dot_product_attention with an additive float mask, and every
decode step has a new key length. This times that call for a few consecutive lengths
(each new length is a new shape: a backend that plans per shape pays that every step),
once with torch's default choice and once forced to each backend.

    python bench/sdpa_decode.py [--heads 32] [--head-dim 128] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--start", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    h, d = args.heads, args.head_dim
    choices = [("default", None)] + [
        (b.name, b)
        for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    ]
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; batch 1, {h} heads x {d}")
    print("| backend | first length | median step (new length each step) | same length again |")
    print("|---|---:|---:|---:|")
    for idx, (name, backend) in enumerate(choices):
        times, again = [], []
        try:
            for i in range(args.steps):
                n = args.start + 4096 * idx + i  # lengths no earlier backend saw
                q = torch.randn(1, h, 1, d, device="cuda", dtype=dt)
                k = torch.randn(1, h, n, d, device="cuda", dtype=dt)
                v = torch.randn(1, h, n, d, device="cuda", dtype=dt)
                m = torch.zeros(1, 1, 1, n, device="cuda", dtype=dt)
                ctx = sdpa_kernel([backend]) if backend is not None else torch.no_grad()
                with ctx:
                    times.append(step(q, k, v, m))
                    again.append(step(q, k, v, m))
        except RuntimeError as exc:
            print(f"| {name} | - | not available: {str(exc).splitlines()[0][:80]} | - |")
            continue
        times.sort()
        again.sort()
        print(
            f"| {name} | {args.start} | {1e3 * times[len(times) // 2]:.2f} ms "
            f"| {1e3 * again[len(again) // 2]:.3f} ms |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode speed of the three attention paths on ONE loaded model, alternated round by round.

    python bench/gpu/decode_ab.py DIR [--device cuda] [--batch 1,32] [--prompt-tokens 896]
                                  [--tokens 128] [--rounds 5] [--json FILE]

`qwen-kvprep profile` measures each mode in a child process of its own, minutes apart; on
a shared host the batch-1 figures of two such children differ by more than the effect
being measured (bench/RESULTS.md). Here the model is built once from DIR's config.json
with random weights (qwen-kvprep's assembled folder, as `profile --random-weights`
builds it, with the fast path installed) and the three modes take turns, `--rounds` times
per batch size:

  unquantized   the plain cache; torch's SDPA with cuDNN's backend off
  int8-own      the Int8 cache through the model's own code and the compiled kernels
  int8-fast     the Int8 cache through qwen-kvprep's fast path

Each turn: the prompt (the same random tokens for every row), then `--tokens` greedy
steps one token at a time, timed with the device synchronised. Prints a table of the
median decode tokens/s per mode and the ratios; exit status 0 (the targets are reported,
not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("unquantized", "int8-own", "int8-fast")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def decode_rate(model: Any, batch: int, prompt: int, new: int, device: str) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)
    row = torch.randint(0, int(model.config.vocab_size), (1, prompt), generator=gen)
    ids = row.repeat(batch, 1).to(device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1, :].argmax(-1)
        del out
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(new):
            out = model(input_ids=token[:, None], past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1, :].argmax(-1)
            del out
        _sync(device)
        took = time.perf_counter() - t0
    del past
    return batch * new / took


def set_mode(model: Any, mode: str) -> None:
    from qwen_kvprep.runtime import FAST_OFF, attention_layers, set_cache_quantization

    set_cache_quantization(model, mode != "unquantized")
    for _, layer in attention_layers(model):
        setattr(layer, FAST_OFF, mode == "int8-own")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--prompt-tokens", type=int, default=896)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]

    from qwen_kvprep.profile.source import model_source

    with model_source(args.dir, random_weights=True) as src:
        # transformers reads the modules cache's place at import: set it first
        os.environ.update(src.child_env)
        import torch

        from qwen_kvprep.profile.child import plant_kernels
        from qwen_kvprep.runtime import (
            FAST_STEPS,
            attention_layers,
            model_from_config,
            pretrained_config,
        )

        if args.device == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(False)
        plant_kernels(src.load_from)
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        flags = {"use_cache_quantization": True, "use_cache_kernel": True,
                 "use_flash_attn": False, "bf16": dtype == torch.bfloat16, "fp16": False,
                 "fp32": dtype == torch.float32}
        config = pretrained_config(src.load_from, **flags)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = model_from_config(config, torch_dtype=dtype).eval()
        layers = [m for _, m in attention_layers(model)]
        rates: dict[int, dict[str, list[float]]] = {b: {m: [] for m in MODES} for b in batches}
        fast_layers: dict[int, int] = {}
        for batch in batches:
            for _ in range(args.rounds):
                for mode in MODES:
                    set_mode(model, mode)
                    for layer in layers:
                        setattr(layer, FAST_STEPS, 0)
                    rate = decode_rate(model, batch, args.prompt_tokens, args.tokens, args.device)
                    rates[batch][mode].append(rate)
                    if mode == "int8-fast":
                        fast_layers[batch] = sum(1 for m in layers if getattr(m, FAST_STEPS, 0))
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"# {name}; torch {torch.__version__}; {args.prompt_tokens} + {args.tokens} tokens; "
          f"median of {args.rounds} alternated rounds; cuDNN SDPA off")
    print("| batch | unquantized tok/s | int8 own code | int8 fast path | fast / unquantized "
          "| fast / own | fast layers |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    doc: dict[str, Any] = {"device": name, "rounds": args.rounds, "rows": []}
    for batch in batches:
        med = {m: statistics.median(rates[batch][m]) for m in MODES}
        print(f"| {batch} | {med['unquantized']:,.1f} | {med['int8-own']:,.1f} "
              f"| {med['int8-fast']:,.1f} | {med['int8-fast'] / med['unquantized']:.2f}x "
              f"| {med['int8-fast'] / med['int8-own']:.2f}x "
              f"| {fast_layers.get(batch, 0)}/{len(layers)} |")
        doc["rows"].append({"batch": batch, "median": med, "samples": rates[batch],
                            "fast_layers": fast_layers.get(batch, 0), "layers": len(layers)})
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

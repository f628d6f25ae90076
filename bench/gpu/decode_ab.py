"""Decode speed of the three attention paths on ONE loaded model, alternated round by round.

    python bench/gpu/decode_ab.py DIR [--device cuda] [--batch 1,32] [--prompt-tokens 896]
                                  [--tokens 128] [--rounds 5] [--json FILE]
                                  [--cpu-timer wall|thread] [--modes unquantized,int8-fast]

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
steps one token at a time, timed with the device synchronised. On a CPU shared with other
jobs, `--cpu-timer thread` runs torch on one thread and times that thread's CPU time
instead of the wall clock (as `bench/kernels.py --cpu-timer thread` does): other jobs
then stretch neither mode's figure. `--modes` picks which of the three take turns. Prints
a table of the median decode tokens/s per mode and the ratios; exit status 0 (the targets
are reported, not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("unquantized", "int8-own", "int8-fast")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def decode_rate(
    model: Any, batch: int, prompt: int, new: int, device: str, clock: Callable[[], float]
) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)
    row = torch.randint(0, int(model.config.vocab_size), (1, prompt), generator=gen)
    ids = row.repeat(batch, 1).to(device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1, :].argmax(-1)
        del out
        _sync(device)
        t0 = clock()
        for _ in range(new):
            out = model(input_ids=token[:, None], past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1, :].argmax(-1)
            del out
        _sync(device)
        took = clock() - t0
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
    p.add_argument("--cpu-timer", choices=("wall", "thread"), default="wall",
                   help="CPU: wall time (all threads), or one thread's CPU time (a busy host)")
    p.add_argument("--modes", default=",".join(MODES), help="which modes take turns")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "unquantized" not in modes:
        p.error(f"--modes takes unquantized and any of int8-own, int8-fast; got {args.modes}")
    thread_clock = args.device == "cpu" and args.cpu_timer == "thread"
    clock = time.thread_time if thread_clock else time.perf_counter

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
        if thread_clock:
            torch.set_num_threads(1)
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
        rates: dict[int, dict[str, list[float]]] = {b: {m: [] for m in modes} for b in batches}
        # Per round, what the caching allocator held and how often it had to free and retry
        # (a speed that falls round after round on one loaded model is a memory question
        # first): reserved and allocated bytes after the round, and the retries it cost.
        memory: dict[int, dict[str, list[dict[str, int]]]] = {
            b: {m: [] for m in modes} for b in batches
        }
        fast_layers: dict[int, int] = {}
        for batch in batches:
            for _ in range(args.rounds):
                for mode in modes:
                    set_mode(model, mode)
                    for layer in layers:
                        setattr(layer, FAST_STEPS, 0)
                    rate = decode_rate(model, batch, args.prompt_tokens, args.tokens, args.device,
                                       clock)
                    rates[batch][mode].append(rate)
                    if mode == "int8-fast":
                        fast_layers[batch] = sum(1 for m in layers if getattr(m, FAST_STEPS, 0))
                    if args.device == "cuda":
                        stats = torch.cuda.memory_stats()
                        memory[batch][mode].append({
                            "reserved": int(torch.cuda.memory_reserved()),
                            "allocated": int(torch.cuda.memory_allocated()),
                            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
                            "device_allocs": int(stats.get("num_device_alloc", 0)),
                        })
                        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    timer = "one thread's CPU time" if thread_clock else "wall clock"
    print(f"# {name}; torch {torch.__version__}; {args.prompt_tokens} + {args.tokens} tokens; "
          f"median of {args.rounds} alternated rounds; cuDNN SDPA off; {timer}")
    heads = {"unquantized": "unquantized tok/s", "int8-own": "int8 own code",
             "int8-fast": "int8 fast path"}
    ratios = [(a, b) for a, b in (("int8-fast", "unquantized"), ("int8-fast", "int8-own"),
                                  ("int8-own", "unquantized")) if a in modes and b in modes][:2]
    short = {"unquantized": "unquantized", "int8-own": "own", "int8-fast": "fast"}
    print("| batch | " + " | ".join(heads[m] for m in modes) + " | "
          + "".join(f"{short[a]} / {short[b]} | " for a, b in ratios) + "fast layers |")
    print("|---:|" + "---:|" * (len(modes) + len(ratios) + 1))
    doc: dict[str, Any] = {"device": name, "rounds": args.rounds,
                           "timer": "thread" if thread_clock else "wall", "rows": []}
    for batch in batches:
        med = {m: statistics.median(rates[batch][m]) for m in modes}
        cells = [f"{med[m]:,.1f}" for m in modes] + [f"{med[a] / med[b]:.2f}x" for a, b in ratios]
        print(f"| {batch} | " + " | ".join(cells)
              + f" | {fast_layers.get(batch, 0)}/{len(layers)} |")
        doc["rows"].append({"batch": batch, "median": med, "samples": rates[batch],
                            "memory": memory[batch],
                            "fast_layers": fast_layers.get(batch, 0), "layers": len(layers)})
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

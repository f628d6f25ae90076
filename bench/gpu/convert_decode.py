"""Decode speed of a converted Qwen-7B against Qwen's remote code, in one run.

    python bench/gpu/convert_decode.py DIR [--device cuda] [--batch 1,32]
        [--prompt-tokens 896] [--tokens 128] [--rounds 3] [--no-compile] [--json FILE]
        [--work DIR]

DIR holds a Qwen (v1) config.json (tests/data/qwen-7b-chat-config: Qwen-7B-Chat's). The
model is built from it with random weights and qwen-kvprep's imitation of Qwen's remote
code (or the folder's own .py files), with the Int8 cache's fast path as `fix` installs it;
its weights are written as a checkpoint (the tokenizer files of a tiny generated one: the
speed does not depend on them) and converted with `qwen-kvprep convert --no-verify`. Then
three modes take turns, `--rounds` times per batch size, on the same machine:

  remote-unquantized   Qwen's code with its plain cache (eager decode, torch SDPA)
  remote-int8-fast     Qwen's code with the Int8 cache through the fast path (fix)
  converted-static     OUT as Qwen2ForCausalLM: transformers' static cache, the forward
                       compiled by torch.compile (mode reduce-overhead, fullgraph), as
                       `convert` prints it (--no-compile: the static cache alone)

Each turn: the same random prompt of `--prompt-tokens` for every row, then `--tokens`
greedy tokens; tokens/s = batch x tokens / the decode time. The remote code's turn times
its own loop of forwards; the converted model's is `generate` (the static cache needs it):
a logits processor notes the time of each step, so its prefill is left out too. Prints a
table of the medians and the ratios; exit status 0 (reported, not judged). A mode that
runs out of memory is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("remote-unquantized", "remote-int8-fast", "converted-static")
TOKENIZER_FILES = ("qwen.tiktoken", "tokenizer_config.json", "generation_config.json")
SHARD_BYTES = 2 * 2**30


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _prompt(vocab: int, batch: int, tokens: int, device: str) -> Any:
    import torch

    gen = torch.Generator().manual_seed(0)
    # ids of the tiny tokenizer's range: any id is a token to the model
    row = torch.randint(0, min(vocab, 256), (1, tokens), generator=gen)
    return row.repeat(batch, 1).to(device)


def write_checkpoint(model: Any, assembled: Path, dest: Path, dtype_flag: str) -> None:
    """The built model as a Qwen (v1) checkpoint in `dest`: config.json with the dtype
    flag, the code, a tiny tokenizer's files, safetensors shards and their index."""
    from safetensors.torch import save_file

    from qwen_kvprep.tiny import generate_checkpoint

    dest.mkdir(parents=True)
    config = json.loads((assembled / "config.json").read_text())
    for flag in ("bf16", "fp16", "fp32"):
        config[flag] = flag == dtype_flag
    for key in ("use_cache_quantization", "use_cache_kernel"):
        config.pop(key, None)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in assembled.glob("*.py"):
        shutil.copyfile(path, dest / path.name)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = generate_checkpoint(Path(tmp) / "tiny", layers=1)
        for name in TOKENIZER_FILES:
            if not (dest / name).exists():
                shutil.copyfile(tiny / name, dest / name)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dest / fname), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = fname
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert(src: Path, out: Path) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "qwen_kvprep", "convert", str(src), str(out), "--no-verify"],
        capture_output=True, text=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"convert failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    return time.perf_counter() - t0


def remote_rate(model: Any, batch: int, prompt: int, new: int, device: str) -> float:
    from decode_ab import decode_rate

    return float(decode_rate(model, batch, prompt, new, device, time.perf_counter))


def static_rate(model: Any, batch: int, prompt: int, new: int, device: str) -> float:
    """Decode tokens/s through generate with the static cache: a logits processor notes
    the time after each forward (synchronised), so the `new` - 1 decode steps are timed
    from the first token's logits to the last, the prefill left out."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):  # type: ignore[misc, unused-ignore]
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            _sync(device)
            self.times.append(time.perf_counter())
            return scores

    ids = _prompt(int(model.config.vocab_size), batch, prompt, device)
    mask = torch.ones_like(ids)

    def run() -> float:
        clock = Clock()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, cache_implementation="static",
                           pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
        if len(clock.times) != new:
            raise RuntimeError(f"generate took {len(clock.times)} steps, not {new}")
        return batch * (new - 1) / (clock.times[-1] - clock.times[0])

    run()  # compiles (or warms up) for this batch size and cache length
    return run()


def load_converted(out: Path, device: str, compile_forward: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model: Any = AutoModelForCausalLM.from_pretrained(str(out), **{key: dtype})
    model = model.to(device).eval()
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    gc.repetition_penalty = None
    if hasattr(gc, "disable_compile"):
        gc.disable_compile = True  # compiled here, once, as `convert` prints it
    if compile_forward:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return model


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", default="1,32")
    p.add_argument("--prompt-tokens", type=int, default=896)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--work", type=Path, default=None, help="where the checkpoints go")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be at least 2")
    batches = [int(b) for b in args.batch.split(",")]

    from qwen_kvprep.profile.source import model_source

    work = Path(tempfile.mkdtemp(prefix="convert-decode-", dir=args.work))
    try:
        with model_source(args.dir, random_weights=True) as src:
            os.environ.update(src.child_env)  # transformers reads it at import
            import torch
            from decode_ab import set_mode

            from qwen_kvprep.profile.child import plant_kernels
            from qwen_kvprep.runtime import model_from_config, pretrained_config

            if args.device == "cuda":
                torch.backends.cuda.enable_cudnn_sdp(False)
            plant_kernels(src.load_from)
            dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
            flag = "bf16" if dtype == torch.bfloat16 else "fp32"
            flags = {"use_cache_quantization": True, "use_cache_kernel": True,
                     "use_flash_attn": False, "bf16": flag == "bf16", "fp16": False,
                     "fp32": flag == "fp32"}
            config = pretrained_config(src.load_from, **flags)
            torch.manual_seed(0)
            with torch.device(args.device):
                remote = model_from_config(config, torch_dtype=dtype).eval()
            t0 = time.perf_counter()
            write_checkpoint(remote, src.load_from, work / "qwen", flag)
            wrote = time.perf_counter() - t0
            out = work / "converted"
            converted_s = convert(work / "qwen", out)
            converted = load_converted(out, args.device, args.compile)
            rates: dict[int, dict[str, list[Optional[float]]]] = {
                b: {m: [] for m in MODES} for b in batches
            }
            for batch in batches:
                for _ in range(args.rounds):
                    for mode in MODES:
                        try:
                            if mode == "converted-static":
                                rate = static_rate(converted, batch, args.prompt_tokens,
                                                   args.tokens, args.device)
                            else:
                                set_mode(remote, "unquantized" if mode == "remote-unquantized"
                                         else "int8-fast")
                                rate = remote_rate(remote, batch, args.prompt_tokens,
                                                   args.tokens, args.device)
                        except torch.OutOfMemoryError:
                            rate = None
                        rates[batch][mode].append(rate)
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
            name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
            import transformers

            versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    finally:
        shutil.rmtree(work, ignore_errors=True)

    compiled = "torch.compile reduce-overhead" if args.compile else "not compiled"
    print(f"# {name}; {versions}; {args.prompt_tokens} cached + {args.tokens} new tokens; "
          f"median of {args.rounds} alternated rounds; converted: static cache, {compiled}; "
          f"checkpoint written in {wrote:.0f} s, converted in {converted_s:.0f} s")
    print("| batch | remote code, plain cache tok/s | remote code, Int8 fast path tok/s "
          "| converted, static cache tok/s | converted / fast path | converted / plain |")
    print("|---:|---:|---:|---:|---:|---:|")
    doc: dict[str, Any] = {"device": name, "versions": versions, "rounds": args.rounds,
                           "compiled": args.compile, "prompt_tokens": args.prompt_tokens,
                           "tokens": args.tokens, "write_seconds": wrote,
                           "convert_seconds": converted_s, "rows": []}
    for batch in batches:
        med: dict[str, Optional[float]] = {}
        for mode in MODES:
            got = [r for r in rates[batch][mode] if r is not None]
            med[mode] = statistics.median(got) if got else None

        def cell(x: Optional[float]) -> str:
            return f"{x:,.1f}" if x is not None else "out of memory"

        def ratio(a: Optional[float], b: Optional[float]) -> str:
            return f"{a / b:.2f}x" if a and b else "-"

        conv, fast, plain = (med["converted-static"], med["remote-int8-fast"],
                             med["remote-unquantized"])
        print(f"| {batch} | {cell(plain)} | {cell(fast)} | {cell(conv)} | "
              f"{ratio(conv, fast)} | {ratio(conv, plain)} |")
        doc["rows"].append({"batch": batch, "median": med, "samples": rates[batch]})
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

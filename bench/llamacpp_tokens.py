"""`convert`'s output served by llama.cpp: the same tokens and the same greedy decoding as
transformers, on the CPU.

    python bench/llamacpp_tokens.py --tokenizer DIR --llama-cpp SRC [--work W] [--tokens 16]
        [--layers 2] [--json OUT]

DIR holds a Qwen (v1) model repo's tokenizer files (qwen.tiktoken, tokenization_qwen.py,
tokenizer_config.json, generation_config.json; not part of this repository). SRC is a
llama.cpp source tree (its convert_hf_to_gguf.py and gguf-py/; the llama-cpp-python sdist
carries one in vendor/llama.cpp), and the running interpreter has llama-cpp-python
(`pip install llama-cpp-python`, which compiles llama.cpp for the CPU) and what llama.cpp's
converter needs besides torch and transformers (`pip install sentencepiece protobuf`).

A tiny random-weight checkpoint (qwen_kvprep.tiny, fp32) gets DIR's tokenizer and Qwen's
vocabulary size (151,936: its embedding and output layer are drawn again at that size), is
converted by `qwen-kvprep convert` (with its proof), then by llama.cpp's own converter to
GGUF (f32). The script then compares, for texts in several scripts and a ChatML prompt:

- the token ids of llama.cpp's tokenizer (from the GGUF) and of transformers' (from OUT,
  no remote code), and the pre-tokenizer llama.cpp's converter recognised OUT's tokenizer
  as (it hashes the ids of a fixed text: an unknown tokenizer is refused);
- greedy decoding: `--tokens` tokens from each prompt by llama.cpp and by transformers'
  Qwen2ForCausalLM, the largest logit difference on the way, and the smallest gap between
  the best and second-best logit (how close a tie came).

Prints a Markdown table; not part of the test suite (it compiles nothing itself, but
llama-cpp-python's install compiles llama.cpp for several minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
QWEN_VOCAB = 151936
TOKENIZER_FILES = (
    "qwen.tiktoken",
    "tokenization_qwen.py",
    "tokenizer_config.json",
    "generation_config.json",
)
TEXTS = (
    "Hello, my name is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "你好，世界！今天天气很好。",
    "Привет, как дела? 12345 67.89",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Who are you?<|im_end|>\n<|im_start|>assistant\n",
)


def _checkpoint(work: Path, tokenizer: Path, layers: int) -> Path:
    """The tiny fp32 checkpoint with DIR's tokenizer and Qwen's vocabulary size."""
    import torch
    from safetensors.torch import load_file, save_file

    from qwen_kvprep.tiny import generate_checkpoint

    dest = generate_checkpoint(work / "Qwen-tiny", dtype="fp32", layers=layers, shards=1)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, dest / name)
    config = json.loads((dest / "config.json").read_text())
    config["vocab_size"] = QWEN_VOCAB
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator().manual_seed(0)
    for shard in sorted(dest.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in ("transformer.wte.weight", "lm_head.weight"):
            if name in tensors:
                hidden = tensors[name].shape[1]
                tensors[name] = torch.randn((QWEN_VOCAB, hidden), generator=generator) * 0.5
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return dest


def _run(argv: list[str], env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}")
    return proc


def _gguf(out: Path, src: Path, work: Path) -> tuple[Path, str]:
    """llama.cpp's converter on OUT: the GGUF file and the pre-tokenizer it recognised
    (read back from the file with llama.cpp's own gguf-py)."""
    gguf = work / "model-f32.gguf"
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(out),
          "--outfile", str(gguf), "--outtype", "f32"], env)
    sys.path.insert(0, str(src / "gguf-py"))
    from gguf import GGUFReader  # type: ignore[import-not-found]

    field = GGUFReader(str(gguf)).fields["tokenizer.ggml.pre"]
    return gguf, bytes(field.parts[field.data[0]]).decode("utf-8")


def _transformers_side(out: Path, texts: tuple[str, ...], n: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    rows = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        seq = list(ids)
        logits = []
        with torch.no_grad():
            for _ in range(n):
                step = model(torch.tensor([seq])).logits[0, -1].double()
                logits.append(step)
                seq.append(int(step.argmax()))
        rows.append({"ids": ids, "greedy": seq[len(ids):], "logits": logits})
    return rows


def _llama_side(gguf: Path, texts: tuple[str, ...], n: int) -> list[dict[str, Any]]:
    import numpy as np
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=os.cpu_count() or 1,
                logits_all=True, verbose=False)
    rows = []
    for text in texts:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        seq = list(ids)
        logits = []
        for _ in range(n):
            step = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            logits.append(step)
            nxt = int(step.argmax())
            seq.append(nxt)
            llm.eval([nxt])
        rows.append({"ids": ids, "greedy": seq[len(ids):], "logits": logits})
    return rows


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import numpy as np

    out = []
    for text, a, b in zip(TEXTS, ours, theirs):
        diff = 0.0
        scale = 0.0
        gap = float("inf")
        for x, y in zip(a["logits"], b["logits"]):
            x = x.numpy()
            diff = max(diff, float(np.max(np.abs(x - y))))
            scale = max(scale, float(np.max(np.abs(x))))
            top = np.sort(x)[-2:]
            gap = min(gap, float(top[1] - top[0]))
        out.append({
            "text": text,
            "tokens": len(a["ids"]),
            "same_ids": a["ids"] == list(b["ids"]),
            "same_greedy": a["greedy"] == b["greedy"],
            "greedy_transformers": a["greedy"],
            "greedy_llamacpp": b["greedy"],
            "max_logit_diff": diff,
            "max_abs_logit": scale,
            "min_top2_gap": gap,
        })
    return out


def table(rows: list[dict[str, Any]], pre: str, n: int) -> str:
    lines = [
        f"llama.cpp's converter recognised the tokenizer as `{pre}`",
        "",
        f"| text | tokens | same ids | same {n} greedy tokens | max logit diff | max \\|logit\\| "
        "| min top-2 gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shown = r["text"].replace("\n", "\\n").replace("|", "\\|")
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        lines.append(
            f"| `{shown}` | {r['tokens']} | {'yes' if r['same_ids'] else 'NO'} | "
            f"{'yes' if r['same_greedy'] else 'NO'} | {r['max_logit_diff']:.2e} | "
            f"{r['max_abs_logit']:.2f} | {r['min_top2_gap']:.2e} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    missing = [n for n in TOKENIZER_FILES if not (args.tokenizer / n).is_file()]
    if missing:
        parser.error(f"{args.tokenizer} lacks {', '.join(missing)}")
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        parser.error(f"{args.llama_cpp} has no convert_hf_to_gguf.py")
    work = Path(tempfile.mkdtemp(prefix="llamacpp-", dir=args.work))
    try:
        ckpt = _checkpoint(work, args.tokenizer, args.layers)
        out = work / "Qwen-tiny-qwen2"
        _run([sys.executable, "-m", "qwen_kvprep", "convert", str(ckpt), str(out)])
        gguf, pre = _gguf(out, args.llama_cpp, work)
        rows = compare(_transformers_side(out, TEXTS, args.tokens),
                       _llama_side(gguf, TEXTS, args.tokens))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows, pre, args.tokens))
    if args.json is not None:
        args.json.write_text(json.dumps({"pre_tokenizer": pre, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["same_ids"] and r["same_greedy"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

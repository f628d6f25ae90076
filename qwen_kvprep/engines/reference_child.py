"""Child side of the engine smoke's reference: `python -m qwen_kvprep.engines.reference_child`.

Loads OUT as transformers' Qwen2ForCausalLM and, when asked, the original through its own
remote code (from the view convert's proof prepares, so DIR is never written), both in
float32, and generates greedily from the proof's prompts with each: the tokens, the
log-probability of each and the top-2 gap at every step. The parent compares them with
the engine's.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep.childproc import Events, child_parser, exit_child, offline_child_main
from qwen_kvprep.convert.verify_child import greedy
from qwen_kvprep.convert.verify_protocol import PROMPTS
from qwen_kvprep.engines.protocol import (
    DTYPE,
    PHASE_GENERATE,
    PHASE_LOAD_CONVERTED,
    PHASE_LOAD_ORIGINAL,
    RESULT_VERSION,
    Backend,
    ReferenceResult,
    Run,
)

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel


def encode(out: Path) -> list[list[int]]:
    """The prompts as OUT's own tokenizer encodes them (what the engine reads; convert's
    proof showed it encodes as the original's)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    return [list(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]


def load_converted(out: Path) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(out), trust_remote_code=False, torch_dtype=torch.float32
    )
    model.eval()  # type: ignore[no-untyped-call, unused-ignore]
    return model


def load_original(view: Path) -> PreTrainedModel:
    """The original in float32 whatever its config says: Qwen's code casts the model to
    the one of bf16/fp16/fp32 its config sets, so fp32 is set and the others cleared."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(view), trust_remote_code=True)
    config.bf16, config.fp16, config.fp32 = False, False, True
    # the smoke compares the model, not the Int8 cache fix may have switched on
    config.use_cache_quantization = False
    config.use_cache_kernel = False
    model = AutoModelForCausalLM.from_pretrained(
        str(view), config=config, trust_remote_code=True, torch_dtype=torch.float32
    )
    model.eval()  # type: ignore[no-untyped-call, unused-ignore]
    return model


def generate(name: str, model: PreTrainedModel, prompts: list[list[int]], new: int) -> Backend:
    import torch

    t0 = time.perf_counter()
    cpu = torch.device("cpu")
    runs: list[Run] = []
    scale = 0.0
    for index, ids in enumerate(prompts):
        tokens, logits = greedy(model, ids, new, cpu)
        logprobs, gaps = [], []
        for token, step in zip(tokens, logits):
            top = torch.topk(step, 2).values
            gaps.append(float(top[0] - top[1]))
            logprobs.append(float(torch.log_softmax(step.double(), dim=-1)[token]))
            # NaN would lose every comparison and leave the scale sane: it counts as inf
            largest = float(step.abs().max())
            scale = max(scale, largest if math.isfinite(largest) else math.inf)
        runs.append({"prompt": index, "tokens": tokens, "logprobs": logprobs, "gaps": gaps})
    return {"name": name, "runs": runs, "scale": scale, "seconds": time.perf_counter() - t0}


def run(args: argparse.Namespace, ev: Events) -> ReferenceResult:
    import gc

    import torch
    import transformers

    out = Path(args.out)
    torch.manual_seed(0)
    prompts = encode(out)
    ev.start(PHASE_LOAD_CONVERTED)
    model = load_converted(out)
    ev.start(PHASE_GENERATE)
    converted = generate("transformers", model, prompts, args.new_tokens)
    del model
    gc.collect()
    original: Optional[Backend] = None
    if args.original is not None:
        ev.start(PHASE_LOAD_ORIGINAL)
        model = load_original(Path(args.original))
        ev.start(PHASE_GENERATE)
        original = generate("original", model, prompts, args.new_tokens)
    return {
        "result_version": RESULT_VERSION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": DTYPE,
        "prompt_tokens": prompts,
        "converted": converted,
        "original": original,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = child_parser("python -m qwen_kvprep.engines.reference_child")
    p.add_argument("--out", required=True, help="the converted folder")
    p.add_argument("--original", default=None, help="the prepared view of DIR (optional)")
    p.add_argument("--new-tokens", type=int, default=16)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    return offline_child_main(argv, parse, run)


if __name__ == "__main__":
    exit_child(main())

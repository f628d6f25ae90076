"""Child side of the engine smoke: `python -m qwen_kvprep.engines.vllm_child ...`.

Starts vLLM's offline engine (`vllm.LLM`) on OUT in float32 once per KV cache dtype asked
for, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one process to bound and kill),
and generates greedily from the token ids the parent gives: the tokens, the
log-probability of each and the top-2 gap at every step. A dtype the engine refuses is
reported with the engine's own words, and the next one is tried.

The KV cache is reserved at the size the job needs (`kv_cache_memory_bytes`), not the
share of the machine's memory vLLM takes by default (92 % of the RAM on a CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from qwen_kvprep.childproc import Events, child_parser, exit_child, offline_child_main
from qwen_kvprep.engines.protocol import (
    DTYPE,
    PHASE_GENERATE,
    PHASE_IMPORT_ENGINE,
    PHASE_START_ENGINE,
    RESULT_VERSION,
    Backend,
    EngineResult,
    Run,
)

if TYPE_CHECKING:
    from vllm import LLM


class Refusal(TypedDict):
    kv_cache_dtype: str
    error: str  # the engine's exception, "Type: message"


class VllmChildResult(TypedDict):
    version: str
    offered: list[str]  # the KV cache dtypes this vLLM release names
    declared: list[str]  # those its attention backend on this device declares
    runs: list[EngineResult]
    refused: list[Refusal]


def offered_dtypes() -> tuple[list[str], list[str]]:
    """(the release's KV cache dtypes, those the current platform's attention backend
    declares) from vLLM's own definitions."""
    import typing

    from vllm.config.cache import CacheDType

    offered = [str(x) for x in typing.get_args(CacheDType)]
    declared: list[str] = []
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        declared = [str(x) for x in CPUAttentionBackend.supported_kv_cache_dtypes]
    except (ImportError, AttributeError):
        pass
    return offered, declared


def start(out: Path, kv_dtype: str, max_len: int, kv_bytes: int, seqs: int) -> LLM:
    from vllm import LLM

    return LLM(
        model=str(out), dtype=DTYPE, kv_cache_dtype=kv_dtype, max_model_len=max_len,
        kv_cache_memory_bytes=kv_bytes, max_num_seqs=seqs, seed=0, enforce_eager=True,
        # greedy tokens as the model computes them: not the request defaults OUT's
        # generation_config.json gives (repetition_penalty 1.1, top_p 0.8)
        generation_config="vllm",
    )


def generate(llm: LLM, prompts: list[list[int]], new: int, name: str) -> Backend:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=new, logprobs=2, ignore_eos=True, repetition_penalty=1.0,
        top_p=1.0, top_k=-1,
    )
    t0 = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    runs: list[Run] = []
    for index, output in enumerate(outputs):
        done = output.outputs[0]
        tokens = [int(t) for t in done.token_ids]
        logprobs, gaps = [], []
        for token, step in zip(tokens, done.logprobs or []):
            ranked: list[Any] = sorted(step.values(), key=lambda lp: lp.rank or 0)
            values = [float(lp.logprob) for lp in ranked]
            logprobs.append(float(step[token].logprob))
            gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
        runs.append({"prompt": index, "tokens": tokens, "logprobs": logprobs, "gaps": gaps})
    return {"name": name, "runs": runs, "scale": None, "seconds": time.perf_counter() - t0}


def run(args: argparse.Namespace, ev: Events) -> VllmChildResult:
    ev.start(PHASE_IMPORT_ENGINE)
    import vllm
    from vllm.distributed import cleanup_dist_env_and_memory

    prompts: list[list[int]] = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
    offered, declared = offered_dtypes()
    runs: list[EngineResult] = []
    refused: list[Refusal] = []
    for kv_dtype in args.kv_cache_dtype:
        ev.start(f"{PHASE_START_ENGINE}:{kv_dtype}")
        llm: Optional[LLM] = None
        if kv_dtype not in offered:
            refused.append({"kv_cache_dtype": kv_dtype,
                            "error": f"vLLM {vllm.__version__} has no such KV cache dtype"})
            continue
        try:
            llm = start(Path(args.out), kv_dtype, args.max_len, args.kv_bytes, len(prompts))
            resolved = str(llm.llm_engine.vllm_config.cache_config.cache_dtype)
            ev.start(f"{PHASE_GENERATE}:{kv_dtype}")
            backend = generate(llm, prompts, args.new_tokens, f"vllm:{kv_dtype}")
            runs.append({
                "result_version": RESULT_VERSION, "engine": "vllm",
                "version": str(vllm.__version__), "kv_cache_dtype": kv_dtype,
                "resolved_kv_cache_dtype": resolved, "dtype": DTYPE, "backend": backend,
            })
        except Exception as exc:  # the engine's refusal is the measurement
            refused.append({"kv_cache_dtype": kv_dtype, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
    return {"version": str(vllm.__version__), "offered": offered, "declared": declared,
            "runs": runs, "refused": refused}


def parse(argv: list[str]) -> argparse.Namespace:
    p = child_parser("python -m qwen_kvprep.engines.vllm_child")
    p.add_argument("--out", required=True, help="the converted folder")
    p.add_argument("--prompts", required=True, help="a JSON file: a list of token id lists")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-len", type=int, required=True, help="max_model_len")
    p.add_argument("--kv-bytes", type=int, required=True, help="kv_cache_memory_bytes")
    p.add_argument("--kv-cache-dtype", action="append", required=True)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    # the engine core in this process: one process group for the parent to bound and kill
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # no pinning of OpenMP threads to cores: on a shared machine a pinned, spinning thread
    # waits for its core (16 greedy tokens took 41 s pinned, 8 s unpinned on 2 busy cores)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return offline_child_main(argv, parse, run)


if __name__ == "__main__":
    exit_child(main())

"""Child side of the engine smoke: `python -m qwen_kvprep.engines.vllm_child ...`.

Starts vLLM's offline engine (`vllm.LLM`) in float32 once per run the parent plans (a KV
cache dtype on OUT, or on OUT's view without its KV scales), in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: one process to bound and kill). Each start scores the
passage (kvjudge.passage) with prompt log-probabilities, read in chunks so that later chunks
read earlier ones back from the quantized cache, and reports the KV scales its attention
layers hold; the reference start (the unquantized cache) also generates greedily from the
token ids the parent gives: the tokens, the log-probability of each and the top-2 gap at
every step. A start the engine refuses is reported with the engine's own words, and the
next one is tried.

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
    PHASE_SCORE,
    PHASE_START_ENGINE,
    RESULT_VERSION,
    Backend,
    EngineResult,
    EngineRun,
    Run,
)
from qwen_kvprep.kvjudge.passage import CHUNK_TOKENS, PASSAGE, TOP_K, passage_ids

if TYPE_CHECKING:
    from vllm import LLM


class Refusal(TypedDict):
    kv_cache_dtype: str
    scales: str
    error: str  # the engine's exception, "Type: message"


class VllmChildResult(TypedDict):
    version: str
    offered: list[str]  # the KV cache dtypes this vLLM release names
    declared: list[str]  # those its attention backend on this device declares
    passage_tokens: int
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


def start(folder: Path, kv_dtype: str, max_len: int, kv_bytes: int, seqs: int) -> LLM:
    from vllm import LLM

    return LLM(
        model=str(folder), dtype=DTYPE, kv_cache_dtype=kv_dtype, max_model_len=max_len,
        kv_cache_memory_bytes=kv_bytes, max_num_seqs=seqs, seed=0, enforce_eager=True,
        # greedy tokens as the model computes them: not the request defaults OUT's
        # generation_config.json gives (repetition_penalty 1.1, top_p 0.8)
        generation_config="vllm",
        # the passage is read CHUNK_TOKENS at a time, each chunk attending to the earlier
        # ones through the cache; no prefix cache, so every start computes its own
        enable_chunked_prefill=True, max_num_batched_tokens=max(CHUNK_TOKENS, seqs),
        enable_prefix_caching=False, max_logprobs=TOP_K,
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


def score_passage(llm: LLM, passage: list[int]) -> list[dict[str, float]]:
    """The engine's top-k log-probabilities at each position of the passage from the
    second (the prompt token itself is dropped where it ranks below the top-k, so every
    position holds the same kind of set)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_K)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=passage)], params, use_tqdm=False)
    positions = list(output.prompt_logprobs or [])[1:]
    if len(positions) != len(passage) - 1:
        raise RuntimeError(f"the engine returned {len(positions)} prompt positions for a "
                           f"passage of {len(passage)} tokens")
    return [{str(t): float(lp.logprob) for t, lp in (step or {}).items()
             if lp.rank is not None and lp.rank <= TOP_K} for step in positions]


def _layer_scales(model: Any) -> list[tuple[str, float, float]]:
    return [(name, float(m._k_scale_float), float(m._v_scale_float))
            for name, m in model.named_modules() if hasattr(m, "_k_scale_float")]


def engine_scales(llm: LLM) -> tuple[list[float], list[float]]:
    """(k, v) scales as the attention layers hold them, in the order they come."""
    (layers,) = llm.apply_model(_layer_scales)[:1]
    return [k for _, k, _ in layers], [v for _, _, v in layers]


def measure(llm: LLM, run: EngineRun, prompts: list[list[int]], passage: list[int],
            new: int, version: str, ev: Events) -> EngineResult:
    label = f"{run['dtype']}, scales {run['scales']}"
    backend: Optional[Backend] = None
    if run["reference"]:
        ev.start(f"{PHASE_GENERATE}:{label}")
        backend = generate(llm, prompts, new, f"vllm:{run['dtype']}")
    ev.start(f"{PHASE_SCORE}:{label}")
    k, v = engine_scales(llm)
    config = llm.llm_engine.vllm_config
    return {
        "result_version": RESULT_VERSION, "engine": "vllm", "version": version,
        "kv_cache_dtype": run["dtype"],
        "resolved_kv_cache_dtype": str(config.cache_config.cache_dtype), "dtype": DTYPE,
        "scales": run["scales"], "reference": run["reference"], "backend": backend,
        "scored": score_passage(llm, passage),
        "chunk": int(config.scheduler_config.max_num_batched_tokens),
        "engine_k_scale": k, "engine_v_scale": v,
    }


def run(args: argparse.Namespace, ev: Events) -> VllmChildResult:
    ev.start(PHASE_IMPORT_ENGINE)
    import vllm
    from transformers import AutoTokenizer
    from vllm.distributed import cleanup_dist_env_and_memory

    prompts: list[list[int]] = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
    plan: list[EngineRun] = json.loads(Path(args.plan).read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(str(args.out), trust_remote_code=False)
    passage = passage_ids(lambda t: list(tokenizer.encode(t, add_special_tokens=False)),
                          (PASSAGE,), args.passage_tokens)
    offered, declared = offered_dtypes()
    version = str(vllm.__version__)
    runs: list[EngineResult] = []
    refused: list[Refusal] = []
    for planned in plan:
        kv_dtype = planned["dtype"]
        ev.start(f"{PHASE_START_ENGINE}:{kv_dtype}, scales {planned['scales']}")
        llm: Optional[LLM] = None
        if kv_dtype not in offered:
            refused.append({"kv_cache_dtype": kv_dtype, "scales": planned["scales"],
                            "error": f"vLLM {version} has no such KV cache dtype"})
            continue
        try:
            llm = start(Path(planned["folder"]), kv_dtype, args.max_len, args.kv_bytes,
                        len(prompts))
            runs.append(measure(llm, planned, prompts, passage, args.new_tokens, version, ev))
        except Exception as exc:  # the engine's refusal is the measurement
            refused.append({"kv_cache_dtype": kv_dtype, "scales": planned["scales"],
                            "error": f"{type(exc).__name__}: {exc}"})
        finally:
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
    return {"version": version, "offered": offered, "declared": declared,
            "passage_tokens": len(passage), "runs": runs, "refused": refused}


def parse(argv: list[str]) -> argparse.Namespace:
    p = child_parser("python -m qwen_kvprep.engines.vllm_child")
    p.add_argument("--out", required=True, help="the converted folder (its tokenizer)")
    p.add_argument("--prompts", required=True, help="a JSON file: a list of token id lists")
    p.add_argument("--plan", required=True, help="a JSON file: the engine starts (EngineRun)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--passage-tokens", type=int, required=True)
    p.add_argument("--max-len", type=int, required=True, help="max_model_len")
    p.add_argument("--kv-bytes", type=int, required=True, help="kv_cache_memory_bytes")
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

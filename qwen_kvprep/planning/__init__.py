"""`qwen-kvprep plan`: `plan_checkpoint` puts together reading a checkpoint's shape,
capacity searches, sizes and rendering. The prediction itself (the contract the `profile`
side imports) is qwen_kvprep/plan.py. Nothing here imports torch at import time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from qwen_kvprep.planning.capacity import PlanResult
    from qwen_kvprep.planning.model import ModelFacts


@dataclass(frozen=True)
class CheckpointPlan:
    facts: ModelFacts
    result: PlanResult
    gpu_source: str  # where the GPU's memory figure came from


def fast_path_installed(directory: Path) -> bool:
    """Whether DIR's model code runs the Int8 cache through qwen-kvprep's fast path:
    modeling_qwen.py carries fix's block and the module it imports is there."""
    from qwen_kvprep.common import FAST_FILE, MODELING_FILE
    from qwen_kvprep.fastkv import is_patched
    from qwen_kvprep.untrusted import read_prefix

    if not (Path(directory) / FAST_FILE).is_file():
        return False
    try:
        text = read_prefix(Path(directory) / MODELING_FILE, 16 << 20)[0]
    except OSError:
        return False
    return is_patched(text.decode("utf-8", errors="replace"))


def plan_checkpoint(
    directory: Path,
    batches: tuple[int, ...],
    tokens: tuple[int, ...],
    gpu_memory: Optional[tuple[int, str]] = None,
    dtype: Optional[str] = None,
    prompt_tokens: int = 1,
    prefill_chunk: Optional[int] = None,
) -> CheckpointPlan:
    """The predicted peaks for every batch size and token count, and the largest batch and
    longest context that fit. `gpu_memory` is (bytes, where that figure came from); without
    it, the total of the GPU torch sees."""
    from qwen_kvprep.plan import shape_of
    from qwen_kvprep.planning.capacity import Scenario, make_plan
    from qwen_kvprep.planning.model import read_model

    facts = read_model(directory, dtype)
    if gpu_memory is None:
        from qwen_kvprep.planning.gpu import visible_gpu_memory

        gpu_memory = visible_gpu_memory()
    memory, gpu_source = gpu_memory
    scenario = Scenario(
        prompt_tokens=prompt_tokens,
        prefill_chunk=prefill_chunk,
        gpu_memory_bytes=memory,
        softmax_in_fp32=facts.softmax_in_fp32,
        fast_path=fast_path_installed(directory),
    )
    return CheckpointPlan(facts, make_plan(shape_of(facts), scenario, batches, tokens), gpu_source)

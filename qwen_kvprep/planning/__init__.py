"""`qwen-kvprep plan`: `plan_checkpoint` puts together reading a checkpoint's shape,
capacity searches, sizes and rendering. The prediction itself (the contract the `profile`
side imports) is qwen_kvprep/planning/peak.py. Nothing here imports torch at import time."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep import compat
from qwen_kvprep.chart import check_target
from qwen_kvprep.common import FAST_FILE, MODELING_FILE
from qwen_kvprep.errors import UsageError
from qwen_kvprep.fastkv import is_patched, recognise
from qwen_kvprep.findings import Finding, warn
from qwen_kvprep.planning.capacity import Scenario, make_plan
from qwen_kvprep.planning.gpu import card_memory, find_card, visible_gpu_memory
from qwen_kvprep.planning.model import read_model
from qwen_kvprep.planning.peak import CUDA_CONTEXT_BYTES
from qwen_kvprep.planning.plot import write_plan_plot
from qwen_kvprep.planning.sizes import gib, parse_int_list, parse_size
from qwen_kvprep.planning.split import MAX_GPUS, fewest_gpus, leaf_margin, usable_bytes
from qwen_kvprep.planning.tables import payload, render_text
from qwen_kvprep.probe.env import version_tuple
from qwen_kvprep.untrusted import read_prefix

if TYPE_CHECKING:
    from qwen_kvprep.planning.capacity import PlanResult
    from qwen_kvprep.planning.model import ModelFacts


@dataclass(frozen=True)
class CheckpointPlan:
    facts: ModelFacts
    result: PlanResult
    gpu_source: str  # where the GPU's memory figure came from
    plot: Optional[Path] = None  # the plot drawn (--plot FILE)
    findings: tuple[Finding, ...] = ()  # plan.weights when the weights fit no card


def plan_document(planned: CheckpointPlan) -> dict[str, object]:
    """plan's JSON member: the predictions (and where the plot went)."""
    extra = {} if planned.plot is None else {"plot": str(planned.plot)}
    return {**payload(planned.facts, planned.result, planned.gpu_source), **extra}


def plan_text(planned: CheckpointPlan, shown: str) -> str:
    """plan's text: the tables and findings (and where the plot went)."""
    text = render_text(planned.facts, planned.result, planned.gpu_source, shown=shown,
                       findings=planned.findings)
    return text if planned.plot is None else f"{text}\n\nPlot: {planned.plot}"


def fast_path_installed(directory: Path) -> Optional[bool]:
    """Whether DIR's model code runs the Int8 cache through qwen-kvprep's fast path:
    True when modeling_qwen.py carries fix's block and the module it imports is there;
    False when it carries fix's other lines without it (`fix --no-fast-path`, or code the
    fast path does not know); None when fix has not run (nor the file reads)."""
    try:
        text = read_prefix(Path(directory) / MODELING_FILE, 16 << 20)[0]
    except OSError:
        return False
    code = text.decode("utf-8", errors="replace")
    if is_patched(code):
        return (Path(directory) / FAST_FILE).is_file()
    return False if compat.is_patched(code) else None


def fast_path_planned(directory: Path) -> tuple[bool, bool]:
    """(fast path, pending): the Int8 cache's path the plan is for. A folder `fix` has not
    prepared yet is planned as fix's defaults will leave it: the fast path, where fix knows
    the model's code (fastkv.recognise); `pending` says so."""
    installed = fast_path_installed(directory)
    if installed is not None:
        return installed, False
    try:
        text = read_prefix(Path(directory) / MODELING_FILE, 16 << 20)[0]
    except OSError:
        return False, False
    return recognise(text.decode("utf-8", errors="replace")) is None, True


def plan_checkpoint(
    directory: Path,
    batches: tuple[int, ...],
    tokens: tuple[int, ...],
    gpu_memory: Optional[tuple[int, str]] = None,
    dtype: Optional[str] = None,
    prompt_tokens: int = 1,
    prefill_chunk: Optional[int] = None,
    plot: Optional[Path] = None,
    gpus: int = 1,
) -> CheckpointPlan:
    """The predicted peaks for every batch size and token count, and the largest batch and
    longest context that fit. `gpu_memory` is (bytes, where that figure came from); without
    it, the total of the GPU torch sees. `gpus` cards of that memory hold the model split
    as transformers' device_map="auto" splits it. With `plot`, the peaks are drawn into
    that file."""
    facts = read_model(directory, dtype)
    if gpu_memory is None:
        gpu_memory = visible_gpu_memory()
    memory, gpu_source = gpu_memory
    fast_path, pending = fast_path_planned(directory)
    scenario = Scenario(
        prompt_tokens=prompt_tokens,
        prefill_chunk=prefill_chunk,
        gpu_memory_bytes=memory,
        softmax_in_fp32=facts.softmax_in_fp32,
        fast_path=fast_path,
        fast_path_pending=pending,
        gpus=gpus,
        leaf_margin=leaf_margin(installed_release("transformers")),
    )
    result = make_plan(facts.shape, scenario, batches, tokens)
    if plot is not None:
        plot = write_plan_plot(facts, result, gpu_source, plot)
    return CheckpointPlan(facts, result, gpu_source, plot, weights_findings(result))


def installed_release(package: str) -> Optional[tuple[int, ...]]:
    """The installed release of `package` (read from its metadata, not imported); None
    when it is not installed."""
    try:
        return version_tuple(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def weights_findings(plan: PlanResult) -> tuple[Finding, ...]:
    """plan.weights, when the weights alone fit no card: with the numbers, and the fewest
    cards of this size that hold them."""
    if plan.split.holds_weights:
        return ()
    shape, s = plan.shape, plan.scenario
    free = usable_bytes(s.gpu_memory_bytes)
    room = (f"{gib(free, 2)} GiB usable on a {gib(s.gpu_memory_bytes, 2)} GiB card (less "
            f"{gib(CUDA_CONTEXT_BYTES)} GiB of CUDA context)")
    if s.gpus == 1:
        message = (f"the weights alone ({gib(shape.weights_bytes, 2)} GiB) exceed the card: "
                   f"{room}; no run fits one card")
    else:
        left = ", ".join(m.name for m in plan.split.offloaded[:3])
        more = len(plan.split.offloaded) - 3
        left += f" and {more} more" if more > 0 else ""
        message = (f"the weights ({gib(shape.weights_bytes, 2)} GiB) do not fit {s.gpus} "
                   f"cards split as device_map=\"auto\" splits them, {room} each: {left} "
                   "would be offloaded to the CPU; no run fits")
    need = fewest_gpus(shape, s.gpu_memory_bytes, with_leaf=s.leaf_margin)
    if need:
        fix = (f"--gpus {need}: the fewest cards of this size that hold the weights, split as "
               "transformers' device_map=\"auto\" splits them (or a card with more memory)")
    else:
        fix = (f"not even {MAX_GPUS} such cards hold them: plan for a card with more memory "
               "(--gpu h200, --gpu-memory) or an Int4 GPTQ checkpoint")
    return (warn("plan.weights", message, fix, details={
        "weights_bytes": shape.weights_bytes, "usable_bytes_per_card": free,
        "gpus": s.gpus, "fewest_gpus": need or None}),)


def plan_inputs(
    gpu_name: Optional[str],
    gpu_memory: Optional[str],
    batch_list: str,
    tokens_list: str,
    prompt_tokens: int,
    plot: Optional[Path] = None,
) -> tuple[tuple[int, ...], tuple[int, ...], Optional[tuple[int, str]]]:
    """plan's options, checked before the checkpoint is read (a typo in a list should not
    wait for it): the batches, the token counts, and the GPU memory with where that figure
    came from (None: the GPU torch sees). A --plot FILE that could not be written is
    refused here too."""
    if gpu_name is not None and gpu_memory is not None:
        raise UsageError("--gpu and --gpu-memory both say which GPU to plan for",
                         fix="give one of them")
    batches = parse_int_list(batch_list, "--batch")
    tokens = parse_int_list(tokens_list, "--tokens")
    short = [t for t in tokens if t < prompt_tokens]
    if short:
        raise UsageError(
            f"--tokens {short[0]} is shorter than the {prompt_tokens}-token prompt",
            fix="tokens count the prompt too: raise --tokens or lower --prompt-tokens",
        )
    memory = None
    if gpu_memory is not None:
        memory = (parse_size(gpu_memory), f"--gpu-memory {gpu_memory}")
    elif gpu_name is not None:
        memory = card_memory(find_card(gpu_name))
    if plot is not None:
        check_target(plot)
    return batches, tokens, memory

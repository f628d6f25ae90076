"""The "profile" object of `profile --json`, which the text output and the plot draw from
as well."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, TypedDict

if TYPE_CHECKING:
    from qwen_kvprep.profile.predict import PerToken
    from qwen_kvprep.profile.protocol import DeviceInfo, QualityResult, Versions
    from qwen_kvprep.profile.runner import ProfileRow
    from qwen_kvprep.profile.source import SourceInfo


def peak_measure(device_kind: Optional[str]) -> str:
    """What a row's `peak_bytes` measures on that device: on a GPU the CUDA allocator's
    peak (torch.cuda.max_memory_allocated), the measure plan predicts; on a CPU the
    process's peak resident memory (the interpreter, torch and the weights included), which
    plan does not predict."""
    return "cuda_allocator" if device_kind == "cuda" else "process_rss"


class ModelSummary(TypedDict):
    """The model's shape as plan reads it (None where plan could not) and the attention
    layers the runs found."""

    layers: Optional[int]
    heads: Optional[int]
    head_dim: Optional[int]
    weights_bytes: Optional[int]  # as plan counts them: GPTQ's packed tensors for Int4
    gptq_bits: Optional[int]  # GPTQ checkpoints: 4 for Qwen's Int4
    kv_bytes_per_token: PerToken


class ProfileDocument(TypedDict):
    directory: str
    source: SourceInfo
    device: DeviceInfo
    versions: Versions
    batches: list[int]
    prompt_tokens: int
    new_tokens: int
    prefill_chunk: Optional[int]
    dtype: Optional[str]
    random_weights: bool
    seed: Optional[int]  # of the random weights
    timeout: float
    use_flash_attn: bool
    model: ModelSummary
    peak_measure: str  # peak_measure(device kind): what each row's peak_bytes measures
    rows: list[ProfileRow]
    max_batch: dict[str, Optional[int]]  # per mode; None: no batch ran to the end
    quality: Optional[QualityResult]

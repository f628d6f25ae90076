"""The "profile" object of `profile --json`, which the text output and the plot draw from
as well."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, TypedDict

if TYPE_CHECKING:
    from qwen_kvprep.profile.predict import PerToken
    from qwen_kvprep.profile.protocol import DeviceInfo, QualityResult, Versions
    from qwen_kvprep.profile.runner import ProfileRow
    from qwen_kvprep.profile.source import SourceInfo


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
    rows: list[ProfileRow]
    max_batch: dict[str, Optional[int]]  # per mode; None: no batch ran to the end
    quality: Optional[QualityResult]

"""What a checkpoint folder is, decided once from the probe's facts.

Every piece of advice depends on it: fetching Qwen's remote code into a Llama folder, or
downloading into a Hub cache's own repo folder, would do harm. `identify` is pure; the
`checkpoint.identity` check reports it first, and the other checkpoint checks (through the
registry's QWEN_V1 need) judge a folder only when it is a Qwen (v1) checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from qwen_kvprep.configjson import CONFIG
from qwen_kvprep.probe.checkpoint import REMOTE_CODE_FILES, TIKTOKEN, CheckpointFacts


class Kind(Enum):
    QWEN_V1 = "qwen-v1"  # model_type "qwen": Qwen-1_8B/7B/14B/72B(-Chat), Qwen's remote code
    QWEN_V1_GPTQ = "qwen-v1-gptq"  # the same, with Int4 GPTQ weights (-Int4)
    QWEN2 = "qwen2"  # Qwen1.5, Qwen2, Qwen2.5 (qwen2, qwen2_moe): transformers' own code
    OTHER = "other"  # another family: its model_type is in Identity.model_type
    HUB_REPO = "hub-repo"  # a huggingface_hub cache repo folder (models--ORG--NAME)
    EMPTY = "empty"  # nothing in it yet
    UNKNOWN = "unknown"  # no config.json and none of Qwen's own files
    # a config.json that does not parse, and none of Qwen's files: config.parse says why
    CONFIG_UNREADABLE = "config-unreadable"
    UNREADABLE = "unreadable"  # the folder cannot be listed (checkpoint.files says why)


# transformers' own Qwen2 code reads these model types (Qwen1.5 and later)
QWEN2_TYPES = ("qwen2", "qwen2_moe")
QWEN_V1_KINDS = (Kind.QWEN_V1, Kind.QWEN_V1_GPTQ)


@dataclass(frozen=True)
class Identity:
    kind: Kind
    model_type: Optional[str] = None  # config.json's, when it names one
    # a huggingface_hub cache snapshot (files linked into blobs/ shared by revisions)
    snapshot: bool = False
    # a Qwen2 checkpoint `qwen-kvprep convert` wrote (its provenance.json is there and says
    # so; another tool's file of that name does not count): served
    # natively, so fix, prestart and convert have nothing to do with it
    converted: bool = False

    @property
    def qwen_v1(self) -> bool:
        return self.kind in QWEN_V1_KINDS

    @property
    def config_judged(self) -> bool:
        """Whether config.parse has something to say (a Qwen (v1) config, or one that does
        not parse at all)."""
        return self.qwen_v1 or self.kind is Kind.CONFIG_UNREADABLE


def identify(cp: CheckpointFacts) -> Identity:
    """What `cp` is. A folder whose config.json is missing or damaged still counts as a
    Qwen (v1) checkpoint when it holds Qwen's own files (the file checks then say what to
    re-fetch); one that holds none of them and no config is UNKNOWN."""
    snapshot = cp.repo_id is not None
    if cp.listing_error is not None:
        return Identity(Kind.UNREADABLE, snapshot=snapshot)
    if cp.cache_repo is not None:
        return Identity(Kind.HUB_REPO)
    raw = cp.config.get("model_type") if cp.config is not None else None
    model_type = raw if isinstance(raw, str) else None
    if cp.config is not None:
        if model_type == "qwen":
            return Identity(Kind.QWEN_V1_GPTQ if cp.gptq else Kind.QWEN_V1, model_type, snapshot)
        if model_type in QWEN2_TYPES:
            return Identity(Kind.QWEN2, model_type, snapshot, cp.provenance_ours)
        return Identity(Kind.OTHER, model_type, snapshot)
    if not cp.files and not cp.dangling and not cp.special:
        return Identity(Kind.EMPTY, snapshot=snapshot)
    qwen_files = {*REMOTE_CODE_FILES, TIKTOKEN}
    if qwen_files & {*cp.files, *cp.dangling}:
        return Identity(Kind.QWEN_V1_GPTQ if cp.gptq else Kind.QWEN_V1, None, snapshot)
    if CONFIG in cp.files:
        return Identity(Kind.CONFIG_UNREADABLE, snapshot=snapshot)
    return Identity(Kind.UNKNOWN, snapshot=snapshot)

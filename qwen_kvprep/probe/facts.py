"""The facts every check reads. Plain frozen dataclasses, so checks run on made-up facts.

Each part is probed by its own module (probe/env.py, probe/checkpoint.py, ...) and may be
None when it was not probed (no checkpoint given, torch missing, ...): a check that needs a
missing part reports `skip`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the parts' modules import torch, filelock... only when probing
    from qwen_kvprep.probe.caches import CacheFacts
    from qwen_kvprep.probe.checkpoint import CheckpointFacts
    from qwen_kvprep.probe.converted import ConvertedFacts
    from qwen_kvprep.probe.env import EnvFacts


@dataclass(frozen=True)
class Facts:
    env: Optional[EnvFacts] = None
    checkpoint: Optional[CheckpointFacts] = None
    caches: Optional[CacheFacts] = None
    converted: Optional[ConvertedFacts] = None  # a folder `convert` wrote (provenance.json)

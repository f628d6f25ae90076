"""The facts every check reads. Plain frozen dataclasses, so checks run on made-up facts.

Each part is probed by its own module (probe/env.py, probe/checkpoint.py, ...) and may be
None when it was not probed (no checkpoint given, torch missing, ...): a check that needs a
missing part reports `skip`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Facts:
    env: Optional[Any] = None  # probe.env.EnvFacts
    checkpoint: Optional[Any] = None  # probe.checkpoint.CheckpointFacts
    caches: Optional[Any] = None  # probe.caches.CacheFacts

"""The huggingface_hub command line the user has, for the commands our fix hints name.

huggingface_hub 0.34 introduced `hf` (`hf download`, `hf auth login`); before it the same
commands were `huggingface-cli download` and `huggingface-cli login`, and qwen-kvprep
supports huggingface_hub from 0.19. The version is read from the installed metadata, so
nothing is imported.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Optional

_HF_SINCE = (0, 34)


def _installed() -> Optional[str]:
    try:
        return metadata.version("huggingface_hub")
    except metadata.PackageNotFoundError:
        return None


def has_hf(version: Optional[str]) -> bool:
    """Whether this huggingface_hub release has the `hf` command (an unknown one: the
    newest behaviour)."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return m is None or (int(m.group(1)), int(m.group(2))) >= _HF_SINCE


def download(version: Optional[str] = None) -> str:
    """`hf download`, or `huggingface-cli download` before huggingface_hub 0.34."""
    new = has_hf(version if version is not None else _installed())
    return "hf download" if new else "huggingface-cli download"


def login(version: Optional[str] = None) -> str:
    """`hf auth login`, or `huggingface-cli login` before huggingface_hub 0.34."""
    new = has_hf(version if version is not None else _installed())
    return "hf auth login" if new else "huggingface-cli login"

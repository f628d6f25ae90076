"""Setting huggingface_hub's settings inside a test, the way an environment variable set
before its import would.

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE... once, at import, into
`huggingface_hub.constants`. file_download also copies some of them at its import, and
hf_hub_download reads those copies: HUGGINGFACE_CO_URL_TEMPLATE in every release so far,
ENDPOINT and HF_HUB_CACHE before 0.25. Setting `constants` alone would leave such a
release asking the wrong server and downloading into the user's own cache.
"""

from __future__ import annotations

from typing import Any

import pytest
from huggingface_hub import constants, file_download


def set_hf_constant(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    """Set huggingface_hub's setting `name` everywhere hf_hub_download reads it."""
    monkeypatch.setattr(constants, name, value)
    if hasattr(file_download, name):
        monkeypatch.setattr(file_download, name, value)

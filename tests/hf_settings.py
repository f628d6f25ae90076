"""Setting huggingface_hub's settings inside a test, the way an environment variable set
before its import would.

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE... once, at import, into
`huggingface_hub.constants`, and older releases copy some of them into other modules at
their import (`from .constants import ENDPOINT`): file_download's HUGGINGFACE_CO_URL_TEMPLATE
in every release so far, ENDPOINT and HF_HUB_CACHE before 0.25, hf_api's ENDPOINT (which
snapshot_download asks) in 0.19. Setting `constants` alone would leave such a release
asking the wrong server and downloading into the user's own cache.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

# Imported here, at collection, before any test patches a setting: a module imported first
# inside such a test (huggingface_hub loads its submodules lazily) copies the patched value
# and keeps it after the test, where no later patch finds it (it is not `constants`' value):
# 0.19's snapshot_download then downloaded into an earlier test's cache.
from huggingface_hub import (  # noqa: F401  (imported: patched)
    _snapshot_download,
    constants,
    file_download,
    hf_api,
)

_MISSING = object()


def set_hf_constant(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    """Set huggingface_hub's setting `name` everywhere it was copied to: every loaded
    huggingface_hub module holding the same object as `constants` does."""
    original = getattr(constants, name)
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("huggingface_hub"):
            continue
        if getattr(module, name, _MISSING) is original:
            monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(constants, name, value)

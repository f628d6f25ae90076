"""The huggingface_hub command our fix hints name follows the installed release."""

from __future__ import annotations

from importlib import metadata

from qwen_kvprep import hubcli


def test_hf_from_0_34_on() -> None:
    for version in ("0.34.0", "0.36.2", "1.1.0", "0.34.0rc1"):
        assert hubcli.download(version) == "hf download"
        assert hubcli.login(version) == "hf auth login"
    for version in ("0.19.0", "0.25.2", "0.33.5"):
        assert hubcli.download(version) == "huggingface-cli download"
        assert hubcli.login(version) == "huggingface-cli login"


def test_the_installed_release_decides() -> None:
    installed = metadata.version("huggingface_hub")
    assert hubcli.download() == hubcli.download(installed)
    assert hubcli.has_hf("not a version")  # unknown: the newest spelling

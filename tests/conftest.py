"""Shared test set-up.

- Nothing may reach the network: HF_ENDPOINT points at a closed loopback port unless a test
  starts its own server, HF_HUB_OFFLINE stays unset so offline behaviour is tested on
  purpose, and socket connects to anything but loopback fail in this process.
- One build cache for the whole session (`shared_build_cache`), so the CPU extension is
  compiled once, not once per test; the kernel tests' `cpu_kernel_ext` is that build.
- The `cuda_build` tests run only when a marker expression names them.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Set before any test module imports huggingface_hub (it reads these at import).
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ.pop("HF_TOKEN", None)
os.environ.pop("HUGGING_FACE_HUB_TOKEN", None)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MAX_JOBS", "2")


def _torch_release() -> tuple[int, ...]:
    try:
        version = importlib.metadata.version("torch")
        return tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ()


# The workers fill every core (-n auto), so torch's own threads in each of them, and in
# each process they start, only wait for one another: a tiny model's steps ran up to 14x
# slower with two threads per process than with one. Set before anything imports torch.
# Not with torch 2.0 (the oldest stack CI tests): there a worker died of a segmentation
# fault in two runs of three with it set, in none without. The cause is not found:
# AddressSanitizer, on that stack with it set, found no memory error in our native code and
# no bad or double free in any library, in the test files that run our code in the worker
# (bench/asan_run.sh; bench/RESULTS.md "AddressSanitizer").
if _torch_release() >= (2, 1):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

_real_connect = socket.socket.connect


def _loopback_only(self: socket.socket, address: Any) -> Any:
    if self.family in (socket.AF_INET, socket.AF_INET6):
        host = address[0]
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = host == "localhost"
        if not ok:
            raise OSError(f"test tried to reach {host}: only 127.0.0.1 is allowed")
    return _real_connect(self, address)


socket.socket.connect = _loopback_only  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def shared_build_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build cache shared by every test in the session (the CPU build is compiled once)."""
    return tmp_path_factory.mktemp("kvprep-build-cache")


@pytest.fixture()
def isolated_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_build_cache: Path
) -> Iterator[Path]:
    """Private HF_HOME / HF_MODULES_CACHE per test; the shared build cache, and no CUDA
    toolkit (tests/toolkit.py): the build is the CPU-only one whatever nvcc the machine has."""
    from tests.toolkit import NO_TOOLKIT

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_MODULES_CACHE", str(home / "modules"))
    monkeypatch.setenv("QWEN_KVPREP_CACHE", str(shared_build_cache))
    for name, value in NO_TOOLKIT.items():
        monkeypatch.setenv(name, value)
    yield home


@pytest.fixture(scope="session")
def cpu_kernel_ext(shared_build_cache: Path) -> Any:
    """Our kernels' CPU build, made by the builder fix uses (the .cpp alone, as with
    isolated_hf's environment) in the session's shared build cache: the tests of the kernels
    run what fix installs, and the first fix of the session finds it built (a compile of the
    extension is most of a minute on a small machine)."""
    import importlib.machinery
    import importlib.util

    from qwen_kvprep.buildcache import vendored_sources
    from qwen_kvprep.buildcache.builder import ensure_build, plan_build
    from qwen_kvprep.buildcache.manifest import EXTENSION_NAME
    from qwen_kvprep.buildcache.paths import CacheLayout
    from tests.toolkit import NO_TOOLKIT

    saved = {name: os.environ.get(name) for name in NO_TOOLKIT}
    os.environ.update(NO_TOOLKIT)  # what isolated_hf gives fix: the CPU-only build
    try:
        plan = plan_build(vendored_sources())
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert not plan.cuda, plan.mode
    built = ensure_build(plan, CacheLayout(shared_build_cache), notify=lambda _: None)
    loader = importlib.machinery.ExtensionFileLoader(EXTENSION_NAME, str(built.so))
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, str(built.so), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `cuda_build` tests run when a marker expression names them (`pytest -m
    cuda_build`, CI's cuda stage): they compile the CUDA extension for every architecture
    nvcc supports, minutes on a small machine, and a plain `pytest` would otherwise spend
    them wherever an nvcc and a CUDA build of torch happen to be installed."""
    if "cuda_build" in (config.getoption("markexpr", "") or ""):
        return
    from tests.needs import KINDS, PREFIX

    reason = f"{PREFIX}cuda-build: {KINDS['cuda-build']}"
    for item in items:
        if item.get_closest_marker("cuda_build") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


# ------------------------------------------------------------------ skips CI does not expect

_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple):
        _skips.append((report.nodeid, str(report.longrepr[2])))


def _unexpected_skips() -> list[tuple[str, str]]:
    from tests.needs import allowed_kinds, kind_of

    allowed = allowed_kinds()
    if allowed is None:
        return []
    return [(nodeid, why) for nodeid, why in _skips if kind_of(why) not in allowed]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    unexpected = _unexpected_skips()
    if unexpected:
        from tests.needs import ENV_ALLOWED

        terminalreporter.section("skips this run does not allow")
        terminalreporter.write_line(
            f"{ENV_ALLOWED}={os.environ.get(ENV_ALLOWED)!r} allows only those kinds of skip:"
        )
        for nodeid, why in unexpected:
            terminalreporter.write_line(f"{nodeid}: {why}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0 and _unexpected_skips():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

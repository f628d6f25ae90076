"""A prepared folder serves from any modules cache: a load with a modules cache that fix
never prepared (a fresh HF_HOME, a read-only one) gets the kernel in every layer and the
fast path without prestart, on the running transformers and on 4.53.3 (.venv453); where it
cannot, the load warns naming `qwen-kvprep prestart DIR -- CMD` and the folder, and
QWEN_KVPREP_STRICT=1 fails it; doctor tells such a cache from a fix cut short."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.common import prestart_command
from qwen_kvprep.probe.supply import loader_values, serves_any_modules_cache
from tests import needs
from tests.cli import kvprep
from tests.cli import python as python_code
from tests.toolkit import NO_TOOLKIT

REPO = Path(__file__).resolve().parent.parent
VENV453_PYTHON = REPO / ".venv453" / "bin" / "python"
PLANTED = ("cache_autogptq_cuda_256.cpp", "cache_autogptq_cuda_kernel_256.cu", "qwen_kvprep_kv.py")

LOAD = """
import json, sys, warnings
warnings.simplefilter("always")
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
layers = [m for m in model.modules() if hasattr(m, "kernel_calls")]
model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, do_sample=False,
               min_new_tokens=3)
print(json.dumps({
    "layers": len(layers),
    "kernel": [l.cache_kernels is not None for l in layers],
    "calls": [l.kernel_calls for l in layers],
    "fast": [getattr(l, "qwen_kvprep_fast_steps", 0) for l in layers],
}))
"""


@pytest.fixture(scope="module")
def prepared(
    tmp_path_factory: pytest.TempPathFactory, shared_build_cache: Path
) -> Iterator[dict[str, Any]]:
    """A tiny checkpoint fixed with its own HF_HOME and a private copy of the session's
    build cache (the CPU build, compiled once per session)."""
    from qwen_kvprep.tiny import generate_checkpoint

    root = tmp_path_factory.mktemp("selfsuff")
    ckpt = generate_checkpoint(root / "Tiny-Chat")
    cache = root / "build-cache"
    shutil.copytree(shared_build_cache, cache, symlinks=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWEN_KVPREP_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MAX_JOBS="1",
               TOKENIZERS_PARALLELISM="false", QWEN_KVPREP_CACHE=str(cache),
               PYTHONPATH=str(REPO), **NO_TOOLKIT)
    fixed = {**env, "HF_HOME": str(root / "hf-fix"),
             "HF_MODULES_CACHE": str(root / "hf-fix" / "modules")}
    res = kvprep("fix", str(ckpt), "--no-smoke", env=fixed, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    shutil.copytree(cache, shared_build_cache, dirs_exist_ok=True)  # a build made here
    yield {"ckpt": ckpt, "env": env, "fixed": fixed, "root": root, "cache": cache}


def _fresh(prepared: dict[str, Any], where: Path) -> dict[str, str]:
    env: dict[str, str] = {**prepared["env"], "HF_HOME": str(where),
                           "HF_MODULES_CACHE": str(where / "modules")}
    return env


def _python(which: str) -> Path:
    if which == "4.53":
        if not VENV453_PYTHON.exists():
            needs.skip("venv-4.53", f"{VENV453_PYTHON} is not installed (.ci/run makes it)")
        return VENV453_PYTHON
    return Path(sys.executable)


def _load(python: Path, ckpt: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if python == Path(sys.executable):  # forked where nothing differs (tests/forked.py)
        return python_code(LOAD, str(ckpt), env=env, timeout=600)
    return subprocess.run([str(python), "-c", LOAD, str(ckpt)], env=env, capture_output=True,
                          text=True, timeout=600)


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _read_only(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        mode = p.stat().st_mode
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _writable(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["current", "4.53"])
def test_a_fresh_and_a_read_only_modules_cache_get_the_kernel_and_the_fast_path(
    prepared: dict[str, Any], tmp_path: Path, which: str
) -> None:
    python = _python(which)
    home = tmp_path / "fresh-hf"
    env = _fresh(prepared, home)
    proc = _load(python, prepared["ckpt"], env)
    got = _result(proc)
    assert got["layers"] == 2 and all(got["kernel"]), got
    assert all(c > 0 for c in got["calls"]) and all(s > 0 for s in got["fast"]), got
    for quiet in ("not found", "fast path is not loaded", "qwen-kvprep:"):
        assert quiet not in proc.stderr, proc.stderr[-3000:]
    # nothing was written beside the copy of the code: the folder serves from itself
    modules = home / "modules"
    assert not [p for p in modules.rglob("*") if p.name in PLANTED]

    # the same cache, read-only (an image's, another user's): the same, and untouched
    before = _tree(modules)
    _read_only(modules)
    try:
        proc = _load(python, prepared["ckpt"], env)
        got = _result(proc)
    finally:
        _writable(modules)
    assert all(got["kernel"]) and all(c > 0 for c in got["calls"]), got
    assert all(s > 0 for s in got["fast"]), got
    assert "not found" not in proc.stderr and "qwen-kvprep:" not in proc.stderr
    assert _tree(modules) == before


@pytest.mark.slow
@pytest.mark.parametrize("which", ["current", "4.53"])
def test_without_a_build_the_load_names_prestart_and_strict_fails_it(
    prepared: dict[str, Any], tmp_path: Path, which: str
) -> None:
    python = _python(which)
    ckpt = prepared["ckpt"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # the build fix used is gone, and no build can be made (the cache cannot be created)
    env = {**_fresh(prepared, tmp_path / "fresh-hf"), "QWEN_KVPREP_CACHE": str(blocker / "c")}
    cache, away = prepared["cache"], prepared["root"] / "build-cache-away"
    cache.rename(away)
    try:
        proc = _load(python, ckpt, env)
        strict = _load(python, ckpt, {**env, "QWEN_KVPREP_STRICT": "1"})
    finally:
        away.rename(cache)
    got = _result(proc)
    assert not any(got["kernel"]), got
    advice = f"`{prestart_command(ckpt)}`"
    warning = next(line for line in proc.stderr.splitlines() if "qwen-kvprep: " in line)
    assert "UserWarning" in warning and advice in warning and str(ckpt) in warning, warning
    assert "runs without its kernel" in warning
    assert strict.returncode != 0
    assert "KvprepFallbackError" in strict.stderr and advice in strict.stderr
    assert "QWEN_KVPREP_STRICT=1" in strict.stderr


@pytest.mark.slow
def test_a_fast_path_module_that_is_not_fix_s_is_not_run(
    prepared: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = prepared["ckpt"]
    module = ckpt / "qwen_kvprep_kv.py"
    original = module.read_bytes()
    module.write_bytes(original + b"\nraise SystemExit('not fix version')\n")
    env = _fresh(prepared, tmp_path / "fresh-hf")
    try:
        proc = _load(Path(sys.executable), ckpt, env)
        strict = _load(Path(sys.executable), ckpt, {**env, "QWEN_KVPREP_STRICT": "1"})
    finally:
        module.write_bytes(original)
    got = _result(proc)
    assert all(got["kernel"]) and not any(got["fast"]), got
    warning = next(ln for ln in proc.stderr.splitlines() if "fast path is not loaded" in ln)
    assert "is not the version fix wrote" in warning, warning
    assert f"`{prestart_command(ckpt)}`" in warning and str(ckpt) in warning
    assert strict.returncode != 0 and "KvprepFallbackError" in strict.stderr


def _doctor(prepared: dict[str, Any], env: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    res = kvprep("doctor", str(prepared["ckpt"]), "--json", env=env, timeout=300)
    doc = json.loads(res.stdout)
    out: dict[str, list[dict[str, Any]]] = {}
    for f in doc["findings"]:
        out.setdefault(f["id"], []).append(f)
    return out


def _said(findings: list[dict[str, Any]]) -> str:
    return " ".join(f"{f['severity']} {f['message']} {f['fix']}" for f in findings)


@pytest.mark.slow
def test_doctor_tells_a_fresh_modules_cache_from_a_fix_cut_short(
    prepared: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = prepared["ckpt"]
    # a fresh HF_HOME, before and after a load: nothing to do, and no word of revert
    home = tmp_path / "fresh-hf"
    env = _fresh(prepared, home)
    for _ in range(2):
        found = _doctor(prepared, env)
        for check in ("modules.folder", "modules.complete", "kernels.sources"):
            assert all(f["severity"] == "ok" for f in found[check]), _said(found[check])
            assert "revert" not in _said(found[check])
        _result(_load(Path(sys.executable), ckpt, env))

    # an interrupted fix: the journal says fix planted a file that is not there
    folder = next(Path(prepared["fixed"]["HF_MODULES_CACHE"]).rglob("qwen_kvprep_kv.py")).parent
    planted = folder / "cache_autogptq_cuda_kernel_256.cu"
    kept = planted.read_bytes()
    planted.unlink()
    try:
        found = _doctor(prepared, prepared["fixed"])
    finally:
        planted.write_bytes(kept)
    said = _said(found["modules.complete"])
    assert found["modules.complete"][0]["severity"] == "fail", said
    assert "cut short" in said and "revert" in said and str(planted) in said


@pytest.mark.slow
def test_doctor_advises_prestart_for_a_folder_fixed_by_an_earlier_release(
    prepared: dict[str, Any], tmp_path: Path
) -> None:
    # a compatibility module other than this release's (an earlier one supplies nothing)
    ckpt = prepared["ckpt"]
    loader = ckpt / "qwen_kvprep_compat.py"
    text = loader.read_bytes()
    loader.write_bytes(text + b"# an earlier release\n")
    try:
        home = tmp_path / "fresh-hf"
        env = _fresh(prepared, home)
        before = _doctor(prepared, env)
        python_code(LOAD, str(ckpt), env=env, timeout=600)
        after = _doctor(prepared, env)
    finally:
        loader.write_bytes(text)
    for found in (before, after):
        said = _said(found["modules.folder"])
        assert found["modules.folder"][0]["severity"] == "fail", said
        assert prestart_command(ckpt) in said and "revert" not in said, said
        assert all(f["severity"] == "ok" for f in found["modules.complete"]), said
    assert "never prepared" in _said(after["modules.folder"])


def test_serves_any_modules_cache_needs_this_release_s_files() -> None:
    loader = "_CHECKPOINT = '/m'\n_PRESTART = 'p'\n_FAST_SHA256 = 'aa'\n"
    assert loader_values(loader) == {"_CHECKPOINT": "/m", "_PRESTART": "p", "_FAST_SHA256": "aa"}
    assert serves_any_modules_cache(loader, True, True, True, "aa")
    assert not serves_any_modules_cache(loader, True, True, True, "bb")  # another module
    assert not serves_any_modules_cache(loader, True, False, True, "aa")  # earlier compat
    assert not serves_any_modules_cache(loader, False, True, True, "aa")  # not imported
    assert not serves_any_modules_cache("_CHECKPOINT = '/m'\n", True, True, False, None)
    assert serves_any_modules_cache("_CHECKPOINT = '/m'\n_FAST_SHA256 = None\n",
                                    True, True, False, None)
    assert not serves_any_modules_cache(None, True, True, False, None)


def test_the_compatibility_module_reads_the_loader_as_doctor_does(tmp_path: Path) -> None:
    """templates/qwen_kvprep_compat.py parses the loader itself (it runs where qwen-kvprep
    may not be installed); it must read what probe/supply.py reads, and nothing from a
    file that is not our loader or is a link."""
    import importlib.util

    from qwen_kvprep.buildcache.loader import render_loader
    from qwen_kvprep.resources import templates_dir

    spec = importlib.util.spec_from_file_location(
        "_compat_under_test", templates_dir() / "qwen_kvprep_compat.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path / "code"
    folder.mkdir()
    text = render_loader(Path("/models/it's Qwen"), [tmp_path], {}, None, None, "ab" * 32)
    (folder / "cpp_kernels.py").write_bytes(text)
    read = module.loader_values(folder)
    assert read == loader_values(text.decode("utf-8"))
    assert read["_CHECKPOINT"] == "/models/it's Qwen" and read["_FAST_SHA256"] == "ab" * 32
    assert read["_PRESTART"] == prestart_command("/models/it's Qwen")
    (folder / "cpp_kernels.py").unlink()
    (folder / "cpp_kernels.py").symlink_to(tmp_path / "elsewhere.py")
    (tmp_path / "elsewhere.py").write_bytes(text)
    assert module.loader_values(folder) is None  # never read through a link
    (folder / "cpp_kernels.py").unlink()
    (folder / "cpp_kernels.py").write_text("_CHECKPOINT = '/m'\n")  # not our loader
    assert module.loader_values(folder) is None

"""The trust model of compiled libraries (docs/reference.md, "What is trusted"): a library
someone else compiled is loaded only where it was asked for, and a lock pins it.

Each scenario uses a crafted variant: this machine's own export with its library replaced by
one whose constructor writes a file when it is loaded (dlopen), and its metadata rewritten to
match. The file appearing is the attack succeeding; a positive control shows it does appear
when the crafted library is what the folder asked for.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_kvprep.buildcache.variant import METADATA, SO_FILE
from qwen_kvprep.common import sha256_file
from tests.cli import invoke, kvprep, python
from tests.test_prebuilt import (
    ROOT,
    child_env,
    exported,  # noqa: F401  (fixture)
    finding,
    fix,
    prebuilt_key,
    the_variant,
    tiny,  # noqa: F401  (fixture)
)

pytestmark = pytest.mark.slow

IMPOSTOR_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void impostor_ran(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the crafted library ran\n", f); fclose(f); }
}
"""

# A load as a server does it: the Int8 cache's kernel is imported while the model is built.
LOAD = r"""
import sys, warnings
from transformers import AutoModelForCausalLM
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
print("\n".join(str(w.message) for w in caught))
print("LOADED")
"""


@pytest.fixture()
def marker(tmp_path: Path) -> Path:
    return tmp_path / "impostor-ran"


@pytest.fixture()
def impostor(tmp_path: Path, marker: Path) -> Path:
    """A shared library that writes `marker` when loaded."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("c++")
    assert compiler, "the tests compile extensions: a C compiler must be on PATH"
    src = tmp_path / "impostor.c"
    src.write_text(IMPOSTOR_C)
    out = tmp_path / "impostor.so"
    subprocess.run(
        [compiler, "-x", "c", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(out), str(src)],
        check=True,
    )
    # the control: loaded, it runs (the scenarios below would pass vacuously otherwise)
    probe = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(out)!r})"])
    assert probe.returncode == 0 and marker.is_file()
    marker.unlink()
    return out


def craft(export: Path, impostor: Path, dest: Path) -> Path:
    """`export` copied to `dest` with its variant's library replaced by the impostor and
    the metadata rewritten to match it (what a variant source under someone else's control
    can serve)."""
    shutil.copytree(export, dest)
    variant = the_variant(dest)
    shutil.copyfile(impostor, variant / SO_FILE)
    digest = sha256_file(variant / SO_FILE)
    metadata = json.loads((variant / METADATA).read_text())
    metadata["files"][SO_FILE] = digest
    metadata["manifest"]["so_sha256"] = digest
    (variant / METADATA).write_text(json.dumps(metadata))
    return dest


def lock_of(source: Path, lock: Path) -> Path:
    res = invoke("build", "--lock", str(source), "--lock-file", str(lock), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    return lock


def load(directory: Path, env: dict[str, str]) -> str:
    done = python(LOAD, str(directory), env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0 and "LOADED" in done.stdout, done.stderr[-3000:]
    return done.stdout


def plant(cache: Path, key: str, manifest: dict[str, object], so: Path) -> None:
    """Put `so` into the build cache under `key`, its manifest claiming it."""
    folder = cache / "builds" / key
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(so, folder / SO_FILE)
    (folder / "manifest.json").write_text(
        json.dumps({**manifest, "key": key, "so_sha256": sha256_file(so)})
    )


def test_a_lock_beats_whatever_the_build_cache_holds(
    exported: Path, tiny: Path, tmp_path: Path, impostor: Path, marker: Path  # noqa: F811
) -> None:
    lock = lock_of(exported, tmp_path / "kvprep.lock.json")
    env = child_env(tmp_path, "server")
    cache = Path(env["QWEN_KVPREP_CACHE"])
    metadata = json.loads((the_variant(exported) / METADATA).read_text())
    genuine = metadata["manifest"]["so_sha256"]
    # the impostor waits where the locked variant will be installed, and where a compile of
    # the same inputs would be, each with a manifest that vouches for it
    plant(cache, prebuilt_key(metadata), {**metadata["manifest"], "origin": "prebuilt"}, impostor)
    plant(cache, metadata["key"], {**metadata["manifest"], "origin": "compiled"}, impostor)

    code, doc = fix(tiny, env, "--prebuilt", str(lock))
    assert code == 0, doc
    assert not marker.exists()
    assert finding(doc, "smoke.kernel")["severity"] == "ok"
    installed = cache / "builds" / prebuilt_key(metadata) / SO_FILE
    assert sha256_file(installed) == genuine
    state = json.loads((tiny / ".qwen-kvprep" / "state.json").read_text())
    assert Path(state["build"]["dir"]).name == prebuilt_key(metadata)

    # swapped after fix, manifest and all: the loader loads only the pinned library
    plant(cache, prebuilt_key(metadata), {**metadata["manifest"], "origin": "prebuilt"}, impostor)
    said = load(tiny, env)
    assert not marker.exists()
    assert f"not the library fix installed (sha256 {genuine})" in said


def test_an_unlocked_install_never_serves_a_plain_fix_or_another_folder(
    exported: Path, tiny: Path, tmp_path: Path, impostor: Path, marker: Path  # noqa: F811
) -> None:
    crafted = craft(exported, impostor, tmp_path / "crafted")
    env = child_env(tmp_path, "server")  # no compiler: only a cached build could serve
    code, doc = fix(tiny, env, "--prebuilt", str(crafted), "--no-smoke")
    assert code == 0, doc  # without a lock the variant's own metadata is all there is
    assert not marker.exists()
    metadata = json.loads((the_variant(crafted) / METADATA).read_text())
    assert not (Path(env["QWEN_KVPREP_CACHE"]) / "builds" / metadata["key"]).exists()
    # the control: the folder that asked for it loads it
    load(tiny, env)
    assert marker.is_file()
    marker.unlink()

    from qwen_kvprep.tiny import generate_checkpoint

    other = Path(generate_checkpoint(tmp_path / "other-qwen", layers=2, shards=1))
    code, doc = fix(other, env, "--no-smoke")
    assert code != 0  # nothing to compile with, and the installed variant is not a build
    assert "using the cached build" not in json.dumps(doc)
    code, doc = fix(other, env, "--no-build", "--no-smoke")
    assert code == 0, doc
    said = load(other, env)  # its loader looks through the cache for a build it may use
    assert not marker.exists()
    assert "not compiled by qwen-kvprep (origin 'prebuilt')" in said


def test_the_prebuilt_source_of_the_environment_wins_in_prestart_and_doctor(
    exported: Path, tiny: Path, tmp_path: Path, impostor: Path, marker: Path  # noqa: F811
) -> None:
    crafted = craft(exported, impostor, tmp_path / "crafted")
    lock = lock_of(exported, tmp_path / "kvprep.lock.json")
    env = child_env(tmp_path, "server")
    code, doc = fix(tiny, env, "--prebuilt", str(crafted), "--no-smoke")
    assert code == 0, doc

    pinned = dict(env, QWEN_KVPREP_PREBUILT=str(lock))
    res = kvprep("doctor", str(tiny), "--json", env=pinned, timeout=300, cwd=ROOT)
    source = finding(json.loads(res.stdout), "prebuilt.source")["message"]
    assert f"in force: {lock} (QWEN_KVPREP_PREBUILT" in source and str(crafted) in source

    res = kvprep("prestart", str(tiny), "--", sys.executable, "-c", LOAD, str(tiny),
                 env=pinned, timeout=900, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "LOADED" in res.stdout
    assert not marker.exists()
    state = json.loads((tiny / ".qwen-kvprep" / "state.json").read_text())
    assert state["sources"]["prebuilt"] == str(lock)
    genuine = json.loads((the_variant(exported) / METADATA).read_text())["manifest"]["so_sha256"]
    assert sha256_file(Path(state["build"]["dir"]) / SO_FILE) == genuine
    assert hashlib.sha256((tiny / "cpp_kernels.py").read_bytes()).hexdigest() in json.dumps(state)

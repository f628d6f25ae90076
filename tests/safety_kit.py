"""Shared set-up of the safety tests: prepared folders made through the real
Journal without transformers (milliseconds) and a sandbox with an `outside/` folder that
nothing may touch."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from qwen_kvprep import __version__
from qwen_kvprep.common import TRACKED_FILES
from qwen_kvprep.journal.writer import Journal
from qwen_kvprep.resources import KERNEL_FILES
from tests.treesnap import Snapshot, snapshot

CONFIG = {
    "architectures": ["QWenLMHeadModel"],
    "auto_map": {"AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "model_type": "qwen",
    "use_flash_attn": "auto",
}
PATCHED = {**CONFIG, "use_cache_quantization": True, "use_cache_kernel": True,
           "use_flash_attn": False}
OFFICIAL_LOADER = b"# Qwen's own cpp_kernels.py (stand-in)\n"
LOADER = b"# qwen-kvprep loader (stand-in)\n"
SOURCES = {KERNEL_FILES[0]: b"// binding\n", KERNEL_FILES[1]: b"// kernels\n"}
MODULE_FILES = {**SOURCES, "cpp_kernels.py": LOADER}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Prepared:
    root: Path  # the sandbox
    directory: Path  # the prepared model folder
    modules: Path  # HF_MODULES_CACHE
    folder: Path  # its transformers_modules/<name>
    outside: Path  # what nothing may touch
    pristine: Snapshot  # snapshot(directory) before the fix


def write_state(directory: Path, modules: Path, folder: Path, build: Optional[Path] = None,
                **changes: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        "state_version": 1,
        "tool_version": __version__,
        "checkpoint": str(directory),
        # as fix records them: every tracked file, None for one that is absent
        "files": {n: sha((directory / n).read_bytes()) if (directory / n).is_file() else None
                  for n in TRACKED_FILES},
        "sources": {"origin": "vendored", "repo_id": None, "revision": None},
        "packages": {n: importlib.metadata.version(n) for n in ("torch", "transformers")},
        "build": None,
        "modules": {"root": str(modules), "folder": str(folder),
                    "files": {n: sha(d) for n, d in MODULE_FILES.items()}, "hub_folder": None},
        "smoke": None,
        "updated": "2025-01-01T00:00:00+00:00",
    }
    if build is not None:
        state["build"] = {"key": "k1", "dir": str(build),
                          "so": str(build / "cache_autogptq_cuda_256.so"),
                          "cuda": False, "arch_list": []}
    state.update(changes)
    (directory / ".qwen-kvprep" / "state.json").write_text(json.dumps(state, indent=2))
    return state


def fake_build(root: Path) -> Path:
    from qwen_kvprep.common import python_tag

    build = root / "cache" / "builds" / "k1"
    build.mkdir(parents=True)
    (build / "cache_autogptq_cuda_256.so").write_bytes(b"\x7fELF")
    (build / "manifest.json").write_text(json.dumps(
        {"manifest_version": 1, "key": "k1", "inputs": {"python_tag": python_tag()}}))
    return build


def prepare(root: Path, name: str = "Tiny-Chat", official_copy: bool = True,
            build: bool = False) -> Prepared:
    """A folder 'fixed' through the real Journal, as fix's steps would: config patched,
    loader and sources written, the three files planted in the modules cache (where
    transformers had already copied Qwen's own cpp_kernels.py), its state recorded.
    HF_MODULES_CACHE must point at root/modules (the caller's monkeypatch)."""
    outside = root / "outside"
    (outside / "dir").mkdir(parents=True, exist_ok=True)
    (outside / "victim.txt").write_text("nothing may touch this\n")
    (outside / "dir" / "f").write_text("nor this\n")
    directory = root / "models" / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (directory / "cpp_kernels.py").write_bytes(OFFICIAL_LOADER)
    (directory / "modeling_qwen.py").write_text("# model code\n")
    os.chmod(directory / "config.json", 0o640)
    pristine = snapshot(directory)
    modules = root / "modules"
    folder = modules / "transformers_modules" / name
    folder.mkdir(parents=True, exist_ok=True)
    if official_copy:
        (folder / "cpp_kernels.py").write_bytes(OFFICIAL_LOADER)
        (folder / "modeling_qwen.py").write_text("# model code\n")
    j = Journal(directory)
    j.write("config.json", (json.dumps(PATCHED, indent=2) + "\n").encode())
    j.write("cpp_kernels.py", LOADER)
    for n, data in SOURCES.items():
        j.write(n, data)
    for n, data in MODULE_FILES.items():
        j.plant(folder / n, data, modules)
    j.register_user(folder)
    write_state(directory, modules, folder, fake_build(root) if build else None)
    return Prepared(root, directory, modules, folder, outside, pristine)


def journal_data(directory: Path) -> dict[str, Any]:
    return json.loads((directory / ".qwen-kvprep" / "journal.json").read_text())


def save_journal(directory: Path, data: Any) -> None:
    (directory / ".qwen-kvprep" / "journal.json").write_text(json.dumps(data, indent=2))

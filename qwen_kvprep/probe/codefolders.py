"""Where the running transformers runs a checkpoint's remote code from, by its own naming.

transformers copies modeling_qwen.py (and the .py files it imports relatively) into
`transformers_modules/<name>/` (4.x; later 4.x sanitize the name) or `<name>/<hash>/`
(5.x: the hash of the code's own bytes) below the modules cache, and imports it from
there. Instead of re-implementing that naming, these functions call transformers' own
helpers (`dynamic_module_utils`, passed in as `dmu`) without writing anything below the
modules cache: the hash runs on a scratch copy of the checkpoint's .py files, for the code
as it will be once `planned` (file name -> bytes) is written. modcache.py (fix) and
probe/caches.py (doctor) both name the folders here, so doctor judges the folder fix
planted into.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Optional

from qwen_kvprep.probe.env import version_tuple
from qwen_kvprep.untrusted import read_regular

MODULE_FILE = "modeling_qwen.py"
DYNAMIC_MODULE_NAME = "transformers_modules"
CODE_LIMIT = 4 << 20  # a .py file of the checkpoint's code (modeling_qwen.py: ~60 KB)
SLASH = "a path ending in / or /."
REAL = "its real path, not the symlink"
# the first release whose folder names doctor asks transformers for (probe/caches.py)
NAMED_BY_HELPERS = (4, 54)


def dynamic_module_utils() -> Optional[ModuleType]:
    """transformers' dynamic_module_utils from 4.54 on, else None: doctor then names the
    folders as transformers 4.32 to 4.53 do (after the path's last part, nothing renamed,
    no hash), without importing a release that writes at import (4.37 creates
    `$HF_HOME/hub/version.txt`, and may move an old cache into it: doctor writes nothing)."""
    try:
        release = version_tuple(importlib.metadata.version("transformers"))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    if release is None or release[:2] < NAMED_BY_HELPERS:
        return None
    try:
        from transformers import dynamic_module_utils as dmu
    except Exception:  # broken: env.transformers says why
        return None
    return dmu


def package_dir(dmu: ModuleType, root: Path) -> Path:
    """`<root>/transformers_modules`, as the running transformers calls its package."""
    return Path(root) / str(getattr(dmu, "TRANSFORMERS_DYNAMIC_MODULE_NAME", DYNAMIC_MODULE_NAME))


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' own logging held back while its helpers answer a question of ours:
    they warn as if a model were being imported ("The module name  (originally ) is not a
    valid Python identifier" for the empty name the slash spelling probes, or a checkpoint
    folder named `class`), which is noise in doctor's and fix's output: what matters there
    is said by our own findings."""
    lib = logging.getLogger("transformers")
    level = lib.level
    lib.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lib.setLevel(level)


def sanitized(dmu: ModuleType, name: str) -> str:
    """A folder name as the running transformers writes it (newer releases rename names
    that cannot be imported: `Qwen-7B` -> `Qwen_hyphen_7B`)."""
    sanitize = getattr(dmu, "_sanitize_module_name", None)
    if not callable(sanitize):
        return name
    with _transformers_quiet():
        return str(sanitize(name))


def code_hash(
    dmu: ModuleType, checkpoint_dir: Path, planned: Optional[Mapping[str, bytes]] = None
) -> Optional[str]:
    """The `<hash>` part of the folder transformers 5 runs a local checkpoint's code from,
    for the code as it will be once `planned` is written; None for a release that names
    the folder after the checkpoint alone, or code it cannot hash (no modeling_qwen.py).

    transformers hashes modeling_qwen.py and the files it imports relatively; its own
    function runs on a scratch copy of the folder's .py files (read as untrusted input), so
    nothing is written to the checkpoint and the hash is exactly the one a load computes."""
    compute = getattr(dmu, "_compute_local_source_files_hash", None)
    if not callable(compute):
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="qwen-kvprep-code-") as tmp:
            scratch = Path(tmp) / "code"
            scratch.mkdir()
            for path in sorted(Path(checkpoint_dir).glob("*.py")):
                try:
                    (scratch / path.name).write_bytes(read_regular(path, CODE_LIMIT))
                except (OSError, ValueError):
                    continue  # not a file transformers could copy either
            for name, data in (planned or {}).items():
                (scratch / name).write_bytes(data)
            with _transformers_quiet():
                return str(_call_hash(dmu, compute, scratch))
    except (OSError, ValueError):  # no modeling_qwen.py, or no temporary folder
        return None


def _call_hash(dmu: ModuleType, compute: Callable[..., object], scratch: Path) -> object:
    """transformers' hash of the code in `scratch`, called as the running release defines it:
    (folder, resolved file) on 5.10 and later; 5.8 and 5.9 also take the module file's name
    and the modules it imports relatively (what their loader passes: check_imports' answer,
    without its check of the packages, which the folder as shipped may not pass)."""
    resolved = str(scratch / MODULE_FILE)
    try:
        takes = len(inspect.signature(compute).parameters)
    except (TypeError, ValueError):
        takes = 2
    if takes >= 4:
        relative = dmu.get_relative_imports(resolved)
        return compute(str(scratch), MODULE_FILE, resolved, relative)
    return compute(str(scratch), resolved)


def local_folder(
    dmu: ModuleType,
    root: Path,
    checkpoint_dir: Path,
    planned: Optional[Mapping[str, bytes]] = None,
) -> Path:
    """The folder a load of the checkpoint by its absolute path runs the code from."""
    source = str(Path(checkpoint_dir).absolute())
    folder = package_dir(dmu, root) / sanitized(dmu, os.path.basename(source))
    digest = code_hash(dmu, Path(source), planned)
    return folder / digest if digest else folder


def spelling_folders(
    dmu: ModuleType,
    root: Path,
    checkpoint_dir: Path,
    planned: Optional[Mapping[str, bytes]] = None,
) -> list[tuple[Path, str]]:
    """Other modules-cache folders a load of this checkpoint by path runs from, besides
    `local_folder`, with how the path is spelt.

    transformers 4.32 to 4.53 name the folder after `os.path.basename` of the path exactly
    as the caller wrote it (docs/qwen-v1.md has the measured table): `DIR/` (what shell
    completion writes) and `DIR/.` give an empty name or `.`, so the model code runs from
    `transformers_modules/` itself; a symlink gives the link's name, and the real folder's
    name when the server loads it by its real path. A spelling ending in `..` is left out:
    transformers cannot import the code from there at all. transformers 5 names the folder
    after the normalised path (`DIR/` and `DIR/.` are DIR) and adds the code's hash below
    it, so there only a symlink's real path is another spelling.
    """
    digest = code_hash(dmu, Path(checkpoint_dir), planned)
    base = package_dir(dmu, root)
    out: list[tuple[Path, str]] = []
    if digest is None and sanitized(dmu, "") == "":
        # newer transformers may rename an empty name; then the slash spelling has its own
        out.append((base, SLASH))
    real = os.path.basename(os.path.realpath(checkpoint_dir))
    if real != os.path.basename(os.path.abspath(checkpoint_dir)):
        folder = base / sanitized(dmu, real)
        out.append((folder / digest if digest else folder, REAL))
    return out


def hub_folder(dmu: ModuleType, root: Path, repo_id: str, commit: str) -> Path:
    """Where transformers runs the remote code of a checkpoint loaded by repo id
    (`from_pretrained("Qwen/Qwen-7B-Chat")`): `transformers_modules/<org>/<name>/<commit>`."""
    parts = [sanitized(dmu, p) for p in repo_id.split("/")]
    return package_dir(dmu, root).joinpath(*parts, commit)

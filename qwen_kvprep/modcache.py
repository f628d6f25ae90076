"""The transformers modules cache: where the model's remote code really runs from.

transformers copies modeling_qwen.py (and the .py files it imports relatively) into
`<HF_MODULES_CACHE>/transformers_modules/<name>/` (transformers 5:
`<name>/<hash>/`, the hash of the code's own bytes) and imports it from there, so the
model looks for the kernel sources and cpp_kernels.py in that folder, not in the
checkpoint. `<name>` and `<hash>` depend on the transformers version; instead of
re-implementing its naming, `module_folder` asks transformers to do exactly what a load
does, and the prediction of a dry run runs transformers' own hash over the code as fix
would leave it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Optional

from qwen_kvprep.common import modules_cache_root
from qwen_kvprep.errors import CacheError, CheckpointError
from qwen_kvprep.untrusted import read_regular

MODULE_FILE = "modeling_qwen.py"
DYNAMIC_MODULE_NAME = "transformers_modules"


def transformers_root() -> Path:
    """The modules-cache root transformers itself uses (it read the environment when it was
    imported); the root planted files are recorded relative to."""
    from transformers import dynamic_module_utils as dmu

    return Path(getattr(dmu, "HF_MODULES_CACHE", None) or modules_cache_root()[0])


CODE_LIMIT = 4 << 20  # a .py file of the checkpoint's code (modeling_qwen.py: ~60 KB)


def code_hash(
    checkpoint_dir: Path, planned: Optional[Mapping[str, bytes]] = None
) -> Optional[str]:
    """The `<hash>` part of the folder transformers 5 runs a local checkpoint's code from,
    for the code as it will be once `planned` (file name -> bytes) is written; None for a
    release that names the folder after the checkpoint alone.

    transformers hashes modeling_qwen.py and the files it imports relatively; its own
    function runs on a scratch copy of the folder's .py files, so nothing is written to
    the checkpoint (a dry run) and the hash is exactly the one a load computes."""
    from transformers import dynamic_module_utils as dmu

    return _code_hash(dmu, Path(checkpoint_dir), planned or {})


def _code_hash(
    dmu: ModuleType, checkpoint_dir: Path, planned: Mapping[str, bytes]
) -> Optional[str]:
    compute = getattr(dmu, "_compute_local_source_files_hash", None)
    if not callable(compute):
        return None
    with tempfile.TemporaryDirectory(prefix="qwen-kvprep-code-") as tmp:
        scratch = Path(tmp) / "code"
        scratch.mkdir()
        for path in sorted(Path(checkpoint_dir).glob("*.py")):
            try:
                (scratch / path.name).write_bytes(read_regular(path, CODE_LIMIT))
            except (OSError, ValueError):
                continue  # not a file transformers could copy either
        for name, data in planned.items():
            (scratch / name).write_bytes(data)
        try:
            return str(compute(str(scratch), str(scratch / MODULE_FILE)))
        except (OSError, ValueError):
            return None


def module_folder(
    checkpoint_dir: Path,
    materialize: bool = True,
    planned: Optional[Mapping[str, bytes]] = None,
) -> Path:
    """The folder the checkpoint's remote code is imported from.

    materialize=True calls transformers' get_cached_module_file, which copies the remote
    code there exactly as from_pretrained would (idempotent). materialize=False predicts
    the folder with transformers' own naming without writing anything (for --dry-run),
    for the code as it will be once `planned` is written.
    """
    from transformers import dynamic_module_utils as dmu

    root = Path(getattr(dmu, "HF_MODULES_CACHE", None) or modules_cache_root()[0])
    package = getattr(dmu, "TRANSFORMERS_DYNAMIC_MODULE_NAME", DYNAMIC_MODULE_NAME)
    source = str(Path(checkpoint_dir).absolute())
    if not materialize:
        name = os.path.basename(source)
        sanitize = getattr(dmu, "_sanitize_module_name", None)
        if callable(sanitize):  # newer transformers rename folders it cannot import
            name = sanitize(name)
        digest = _code_hash(dmu, Path(source), planned or {})
        return root / package / name / digest if digest else root / package / name
    try:
        rel = dmu.get_cached_module_file(source, MODULE_FILE, local_files_only=True)
    except ImportError as exc:
        # transformers checks the remote code's imports (tiktoken, einops, ...) first
        message = f"transformers refuses the remote code of {source}: {exc}"
        fix = (
            "install the packages it names "
            "(pip install tiktoken einops transformers_stream_generator)"
        )
        raise CheckpointError.failing("modules.requirements", message, fix) from exc
    except OSError as exc:
        message = f"cannot copy the remote code of {source} into the modules cache {root}: {exc}"
        fix = "make it writable or point HF_MODULES_CACHE (or HF_HOME) at a writable folder"
        raise CacheError.failing("modules.cache", message, fix, [root]) from exc
    return root / Path(rel).parent


def spelling_folders(
    checkpoint_dir: Path, planned: Optional[Mapping[str, bytes]] = None
) -> list[tuple[Path, str]]:
    """Other modules-cache folders a load of this checkpoint by path runs from, besides
    `module_folder` (the folder of its absolute path's basename), with how it is spelt.

    transformers 4.32 to 4.53 name the folder after `os.path.basename` of the path exactly
    as the caller wrote it (docs/qwen-v1.md has the measured table): `DIR/` (what shell
    completion writes) and `DIR/.` give an empty name or `.`, so the model code runs from
    `transformers_modules/` itself; a symlink gives the link's name, and the real folder's
    name when the server loads it by its real path. fix plants into each of these, so every
    spelling runs the kernel. A spelling ending in `..` is left out: transformers cannot
    import the code from there at all. transformers 5 names the folder after the
    normalised path (`DIR/` and `DIR/.` are DIR) and adds the code's hash below it, so
    there only a symlink's real path is another spelling.
    """
    from transformers import dynamic_module_utils as dmu

    root = Path(getattr(dmu, "HF_MODULES_CACHE", None) or modules_cache_root()[0])
    package = getattr(dmu, "TRANSFORMERS_DYNAMIC_MODULE_NAME", DYNAMIC_MODULE_NAME)
    digest = _code_hash(dmu, Path(checkpoint_dir), planned or {})
    base = root / package
    out: list[tuple[Path, str]] = []
    sanitize = getattr(dmu, "_sanitize_module_name", None)
    if digest is None and (not callable(sanitize) or sanitize("") == ""):
        # newer transformers may rename an empty name; then the slash spelling has its own.
        # transformers 5 names the folder after the normalised path: `DIR/` is DIR's.
        out.append((base, "a path ending in / or /."))
    real = os.path.basename(os.path.realpath(checkpoint_dir))
    if real != os.path.basename(os.path.abspath(checkpoint_dir)):
        name = sanitize(real) if callable(sanitize) else real
        folder = base / name
        out.append((folder / digest if digest else folder, "its real path, not the symlink"))
    return out


def hub_module_folder(repo_id: str, commit: str) -> Path:
    """Where transformers runs the remote code of a checkpoint loaded by repo id
    (`from_pretrained("Qwen/Qwen-7B-Chat")`): `transformers_modules/<org>/<name>/<commit>`.
    There transformers copies a file only when it is absent, so a stale original
    cpp_kernels.py would stay forever; fix plants into this folder too."""
    from transformers import dynamic_module_utils as dmu

    root = Path(getattr(dmu, "HF_MODULES_CACHE", None) or modules_cache_root()[0])
    package = getattr(dmu, "TRANSFORMERS_DYNAMIC_MODULE_NAME", DYNAMIC_MODULE_NAME)
    parts = repo_id.split("/")
    sanitize = getattr(dmu, "_sanitize_module_name", None)
    if callable(sanitize):
        parts = [sanitize(p) for p in parts]
    return root.joinpath(package, *parts, commit)

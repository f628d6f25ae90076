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

from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from qwen_kvprep.common import modules_cache_root
from qwen_kvprep.errors import CacheError, CheckpointError
from qwen_kvprep.probe import codefolders
from qwen_kvprep.probe.codefolders import MODULE_FILE

__all__ = [
    "MODULE_FILE",
    "code_hash",
    "hub_module_folder",
    "module_folder",
    "spelling_folders",
    "transformers_root",
]


def transformers_root() -> Path:
    """The modules-cache root transformers itself uses (it read the environment when it was
    imported); the root planted files are recorded relative to."""
    from transformers import dynamic_module_utils as dmu

    return Path(getattr(dmu, "HF_MODULES_CACHE", None) or modules_cache_root()[0])


def code_hash(
    checkpoint_dir: Path, planned: Optional[Mapping[str, bytes]] = None
) -> Optional[str]:
    """The `<hash>` part of the folder transformers 5 runs a local checkpoint's code from
    (probe/codefolders.py), for the code as it will be once `planned` is written."""
    from transformers import dynamic_module_utils as dmu

    return codefolders.code_hash(dmu, Path(checkpoint_dir), planned)


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

    root = transformers_root()
    source = str(Path(checkpoint_dir).absolute())
    if not materialize:
        return codefolders.local_folder(dmu, root, Path(source), planned)
    try:
        rel = dmu.get_cached_module_file(source, MODULE_FILE, local_files_only=True)
    except ImportError as exc:
        # transformers checks the remote code's imports (tiktoken, einops, ...) first
        message = f"transformers refuses the remote code of {source}: {exc}"
        fix = "install the packages it names (Qwen's code needs tiktoken and einops)"
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
    `module_folder` (the folder of its absolute path's basename), with how it is spelt
    (probe/codefolders.py says which): fix plants into each of these, so every spelling
    runs the kernel."""
    from transformers import dynamic_module_utils as dmu

    return codefolders.spelling_folders(dmu, transformers_root(), Path(checkpoint_dir), planned)


def hub_module_folder(repo_id: str, commit: str) -> Path:
    """Where transformers runs the remote code of a checkpoint loaded by repo id
    (`from_pretrained("Qwen/Qwen-7B-Chat")`): `transformers_modules/<org>/<name>/<commit>`.
    There transformers copies a file only when it is absent, so a stale original
    cpp_kernels.py would stay forever; fix plants into this folder too."""
    from transformers import dynamic_module_utils as dmu

    return codefolders.hub_folder(dmu, transformers_root(), repo_id, commit)

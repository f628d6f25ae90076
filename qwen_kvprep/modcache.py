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
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from qwen_kvprep.common import USERS_DIRNAME, modules_cache_root
from qwen_kvprep.errors import CacheError, CheckpointError
from qwen_kvprep.probe import codefolders
from qwen_kvprep.probe.codefolders import MODULE_FILE
from qwen_kvprep.untrusted import first_link_below

__all__ = [
    "MODULE_FILE",
    "code_hash",
    "hub_module_folder",
    "module_folder",
    "refuse_links",
    "refuse_links_before_fix",
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


def refuse_links(folder: Path, root: Optional[Path] = None) -> None:
    """Refuse (CacheError `modules.link`) a modules-cache folder fix would write into that
    is reached through a symbolic link below the modules cache's root, or whose records
    folder is one: what fix plants or records there would land in the link's target, over
    whatever is there (a user's own cpp_kernels.py), and revert could not reach it again.
    The root itself may be a link: the user named it."""
    base = transformers_root() if root is None else root
    link = first_link_below(base, folder, (USERS_DIRNAME,))
    if link is None:
        return
    try:
        target = f" to {os.readlink(link)}"
    except OSError:
        target = ""
    message = (
        f"{link} is a symbolic link{target} in the modules cache {base}: fix writes only into "
        "folders of the modules cache itself, never through a link it did not make (what it "
        "planted there would replace the files in the folder the link names)"
    )
    fix = (
        f"remove the link (`rm {shlex.quote(link)}`: the next load makes the folder again), "
        "or point HF_MODULES_CACHE at a modules cache without links in it, then run fix again"
    )
    raise CacheError.failing("modules.link", message, fix, [link])


def refuse_links_before_fix(checkpoint_dir: Path) -> None:
    """refuse_links for every folder a load of the checkpoint runs its code from, as the
    code is now (the folder of the code as fix leaves it is checked again as fix plants):
    part of the checks before fix's first write."""
    from transformers import dynamic_module_utils as dmu

    root = transformers_root()
    source = Path(checkpoint_dir).absolute()
    refuse_links(codefolders.local_folder(dmu, root, source), root)
    for folder, _spelt in codefolders.spelling_folders(dmu, root, source):
        refuse_links(folder, root)

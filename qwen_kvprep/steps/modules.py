"""Step of `fix`: put the kernel sources and the loader next to the modules-cache copy of
modeling_qwen.py, where the model looks for them (transformers copies only .py files
there, so the sources are missing and the model silently falls back).

Files are planted through the journal into the folder transformers' naming predicts
(recording what was there for `revert`) before transformers is asked to refresh its copy;
the folder it reports is then checked to hold exactly what was planted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from qwen_kvprep.buildcache import sources_of
from qwen_kvprep.common import (
    FAST_FILE,
    LOADER_FILE,
    USERS_DIRNAME,
    modules_cache_root,
    sha256_bytes,
    sha256_file,
)
from qwen_kvprep.dirlock import TEMP_GRACE_S, remove_leftover_temps
from qwen_kvprep.errors import CacheError
from qwen_kvprep.fastkv import module_bytes
from qwen_kvprep.findings import info, ok, warn
from qwen_kvprep.modcache import (
    hub_module_folder,
    module_folder,
    refuse_links,
    spelling_folders,
    transformers_root,
)
from qwen_kvprep.steps.context import FixContext
from qwen_kvprep.steps.loader import loader_bytes


def _plant_all(ctx: FixContext, folder: Path, files: dict[str, bytes]) -> list[str]:
    root = transformers_root()
    refuse_links(folder, root)
    changed = []
    if not ctx.options.dry_run:
        # a killed write of ours (or of prestart) a while ago; never one in progress
        remove_leftover_temps(folder, set(files), older_than=TEMP_GRACE_S)
        remove_leftover_temps(folder / USERS_DIRNAME, older_than=TEMP_GRACE_S)
    for name, data in files.items():
        try:
            if ctx.journal.plant(folder / name, data, root):
                changed.append(name)
        except OSError as exc:
            message = f"cannot write {folder / name}: {exc.strerror or exc}"
            fix = (
                "make the modules cache writable, or point HF_MODULES_CACHE (or HF_HOME) elsewhere"
            )
            raise CacheError.failing("modules.plant", message, fix, [folder]) from exc
    try:
        # so that reverting another folder of the same name leaves these files alone
        ctx.journal.register_user(folder)
    except OSError as exc:
        message = f"cannot write {folder}: {exc.strerror or exc}"
        raise CacheError.failing("modules.plant", message, paths=[folder]) from exc
    return changed


def run(ctx: FixContext) -> None:
    files = dict(sorted(sources_of(ctx.sources).items()))
    files[LOADER_FILE] = loader_bytes(ctx)
    if ctx.extra.get("fast_path") is True:
        files[FAST_FILE] = module_bytes(ctx.options.per_token_prefill)
    # the checkpoint's code as this run leaves it (a dry run has not written it)
    planned = {
        w.path.name: w.new
        for w in ctx.journal.planned
        if w.path.parent == ctx.directory and w.path.suffix == ".py"
    }
    predicted = module_folder(ctx.directory, materialize=False, planned=planned)
    changed = _plant_all(ctx, predicted, files)
    folder = predicted
    if not ctx.options.dry_run:
        folder = module_folder(ctx.directory)
        if folder != predicted:
            # a transformers naming scheme the prediction missed: plant where it really is
            ctx.add(
                warn(
                    "modules.folder",
                    f"transformers uses {folder}, not {predicted}",
                    paths=[folder, predicted],
                )
            )
            changed += _plant_all(ctx, folder, files)
        wrong = [n for n, d in files.items() if _hash(folder / n) != sha256_bytes(d)]
        if wrong:
            message = f"{', '.join(wrong)} in {folder} differ from what was planted"
            raise CacheError.failing("modules.plant", message, paths=[folder])
    hub_folder = _hub_folder(ctx)
    if hub_folder is not None and hub_folder != folder:
        changed += [f"{n} (for loads by repo id)" for n in _plant_all(ctx, hub_folder, files)]
    also: list[str] = []
    spellings: list[str] = []  # the spellings something was planted for in this run
    for other, spelt in spelling_folders(ctx.directory, planned):
        if other in (folder, hub_folder) or str(other) in also:
            continue
        # the same files where the other spellings of DIR make the model code run from
        planted = _plant_all(ctx, other, files)
        changed += [n for n in planted if n not in changed]
        if planted:
            spellings.append(f"{spelt}: {other}")
        also.append(str(other))
    env_root = Path(os.path.abspath(modules_cache_root()[0]))
    if env_root not in folder.parents:
        ctx.add(
            warn(
                "modules.root",
                f"transformers' modules cache {folder.parent.parent} is not "
                f"the one the environment names ({env_root})",
                paths=[folder],
            )
        )
    hashes = {n: sha256_bytes(d) for n, d in files.items()}
    hub = str(hub_folder) if hub_folder is not None else None
    ctx.modules = {
        "root": str(env_root),
        "folder": str(folder),
        "files": hashes,
        "hub_folder": hub,
        "also": list(also),
    }
    ctx.extra["modules"] = ctx.modules
    verb = "would plant" if ctx.options.dry_run else "planted"
    message = (
        f"{verb} {', '.join(changed)} in the modules cache"
        if changed
        else f"the modules cache already holds {', '.join(files)}"
    )
    if spellings:
        message += (
            " (also where loads by another spelling of the path run from: "
            + "; ".join(spellings) + ")"
        )
    report = info if changed else ok
    ctx.add(
        report("modules.plant", message, paths=[folder, *map(Path, also)], folder=str(folder))
    )


def _hub_folder(ctx: FixContext) -> Optional[Path]:
    """The repo-id folder, when the checkpoint is a huggingface_hub cache snapshot."""
    checkpoint = ctx.facts.checkpoint if ctx.facts is not None else None
    if checkpoint is None:
        return None
    repo_id, commit = checkpoint.repo_id, checkpoint.revision
    if not repo_id or not commit or not re.fullmatch(r"[0-9a-f]{40}", str(commit)):
        return None
    return hub_module_folder(str(repo_id), str(commit))


def _hash(path: Path) -> str:
    try:
        return sha256_file(path)
    except OSError:
        return ""

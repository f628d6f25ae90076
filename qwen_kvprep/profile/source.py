"""What a profile's children load: the checkpoint itself, or, with random weights, a
temporary folder assembled from its config.json.

The assembled folder holds config.json, the model code (the checkpoint's own remote code
when it has one, else qwen-kvprep's re-implementation), qwen-kvprep's loader and kernel
sources. Its children get a private modules cache, into which they plant the loader and
the sources beside the model code, so the Int8 runs use the compiled kernel from the
build cache whether or not the checkpoint was ever fixed, and nothing of the assembled
folder reaches the user's modules cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TypedDict

from qwen_kvprep import compat, fastkv
from qwen_kvprep.common import COMPAT_FILE, FAST_FILE, KERNEL_FILES, LOADER_FILE
from qwen_kvprep.configjson import read_config as read_checked_config
from qwen_kvprep.errors import CheckpointError, ConfigError
from qwen_kvprep.jsontypes import JSONObject
from qwen_kvprep.resources import templates_dir

CONFIG = "config.json"
MODELING = "modeling_qwen.py"
_AUTO_MAP = {
    "AutoConfig": "configuration_qwen.QWenConfig",
    "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
}


class SourceInfo(TypedDict):
    """Where a profile's model came from (the "source" object of --json)."""

    weights: str  # "checkpoint" or "random"
    remote_code: str
    loaded_from: Optional[str]  # None with random weights: a temporary folder


@dataclass(frozen=True)
class ModelSource:
    directory: Path  # what the user named
    load_from: Path  # what the children load
    random_weights: bool
    remote_code: str  # "checkpoint" or "qwen-kvprep"
    plant_kernels: bool
    child_env: dict[str, str] = field(default_factory=dict)
    loader_is_ours: bool = False  # the checkpoint's cpp_kernels.py is qwen-kvprep's loader

    def to_json(self) -> SourceInfo:
        return {
            "weights": "random" if self.random_weights else "checkpoint",
            "remote_code": self.remote_code,
            "loaded_from": str(self.load_from) if not self.random_weights else None,
        }


def read_config(directory: Path) -> JSONObject:
    """config.json, read as fix and doctor read it (a regular file, bounded, strict JSON),
    of a Qwen (v1) checkpoint: another family's config would build a Qwen model of the
    wrong shape and measure nothing of theirs."""
    path = directory / CONFIG
    if not os.path.lexists(path):
        message = f"{directory} has no {CONFIG}"
        fix = "point profile at a Qwen (v1) checkpoint folder (config.json is the minimum)"
        raise CheckpointError.failing("profile.source", message, fix, [path])
    config: JSONObject = dict(read_checked_config(path))
    model_type = config.get("model_type")
    if model_type != "qwen":
        raise ConfigError.failing(
            "profile.source",
            f"{path} has model_type {model_type!r}: profile measures Qwen (v1) checkpoints "
            "(model_type 'qwen') only",
            "point profile at a Qwen (v1) checkpoint such as Qwen/Qwen-7B-Chat "
            "(`qwen-kvprep doctor DIR` says what this folder is)",
            [path],
        )
    return config


def _weights_problem(directory: Path) -> Optional[tuple[str, Optional[str]]]:
    """Why transformers cannot load weights from `directory`, and the command that fetches
    them when one does (Git LFS pointers); None when they are there."""
    from qwen_kvprep.checks.checkpoint import lfs_pull
    from qwen_kvprep.probe.checkpoint import probe_checkpoint

    cp = probe_checkpoint(directory)
    if cp.weights_layout == "none":
        return ("has no weights (no model.safetensors, safetensors index with shards, or .bin)",
                None)
    if cp.index is not None and cp.index.missing:
        missing = ", ".join(cp.index.missing[:3]) + (" …" if len(cp.index.missing) > 3 else "")
        return f"lacks {len(cp.index.missing)} weight file(s) its index lists ({missing})", None
    bad = [p for p in cp.content_problems if p.name in cp.weight_files]
    if bad:
        pointers = [p.name for p in bad if p.kind == "lfs-pointer"]
        fetch = lfs_pull(cp, pointers) if pointers else None
        return f"has weight files that are not weights: {bad[0].name} {bad[0].detail}", fetch
    return None


def _probe_loader(directory: Path) -> bool:
    from qwen_kvprep.buildcache.loader import is_loader

    try:
        return is_loader((directory / LOADER_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return False


@contextmanager
def model_source(directory: Path, random_weights: bool) -> Iterator[ModelSource]:
    """The folder to load; a temporary assembled one (removed afterwards) for random
    weights. Refuses a folder without loadable weights unless random weights are asked."""
    directory = Path(directory).absolute()
    config = read_config(directory)
    has_code = (directory / MODELING).is_file()
    if not random_weights:
        problem = _weights_problem(directory)
        if problem is not None:
            message = f"{directory} {problem[0]}"
            fetch = problem[1] or "download the weights"
            fix = (
                f"{fetch}; or profile the architecture alone with random weights: "
                f"qwen-kvprep profile {directory} --random-weights"
            )
            raise CheckpointError.failing("profile.source", message, fix, [directory])
        yield ModelSource(
            directory=directory,
            load_from=directory,
            random_weights=False,
            remote_code="checkpoint" if has_code else "none",
            plant_kernels=False,
            loader_is_ours=_probe_loader(directory),
        )
        return
    tmp = Path(tempfile.mkdtemp(prefix="qwen-kvprep-profile-"))
    try:
        folder = tmp / "model"  # no dot: transformers imports the folder name as a module
        folder.mkdir()
        _assemble(directory, folder, config, has_code)
        yield ModelSource(
            directory=directory,
            load_from=folder,
            random_weights=True,
            remote_code="checkpoint" if has_code else "qwen-kvprep",
            plant_kernels=True,
            child_env={"HF_MODULES_CACHE": str(tmp / "modules")},
            loader_is_ours=True,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _assemble(directory: Path, folder: Path, config: JSONObject, has_code: bool) -> None:
    from qwen_kvprep.buildcache import read_sources, resolve_cache_dir, vendored_sources
    from qwen_kvprep.buildcache.loader import render_loader, source_hashes
    from qwen_kvprep.tiny import REMOTE_CODE_DIR, REMOTE_FILES

    config = dict(config)
    config.setdefault("auto_map", dict(_AUTO_MAP))
    if has_code:
        for path in sorted(directory.glob("*.py")):
            if path.name != LOADER_FILE:
                shutil.copyfile(path, folder / path.name)
    else:
        for name in REMOTE_FILES:
            if name != LOADER_FILE:
                shutil.copyfile(REMOTE_CODE_DIR / name, folder / name)
        # a bare config (written by hand, or re-saved without remote code) may lack these
        config.setdefault("model_type", "qwen")
        config["auto_map"] = dict(_AUTO_MAP)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    # what Qwen's code needs from this transformers, and the Int8 cache's fast path, as fix
    # installs them (its runs can switch the fast path off)
    modeling = folder / MODELING
    text = modeling.read_text(encoding="utf-8")
    base = compat.unpatched(fastkv.unpatched(text))
    if compat.recognise(base) is None:
        base = compat.patched(base)
        (folder / COMPAT_FILE).write_bytes((templates_dir() / COMPAT_FILE).read_bytes())
    if fastkv.recognise(text) is None:
        base = fastkv.patched(base)
        (folder / FAST_FILE).write_bytes((templates_dir() / FAST_FILE).read_bytes())
    modeling.write_text(base, encoding="utf-8")
    # The checkpoint's own sources when it has both (fix put them there: their build is
    # the one in the cache), else qwen-kvprep's.
    sources = read_sources(directory)
    if set(sources) != set(KERNEL_FILES):
        sources = vendored_sources()
    for name, data in sources.items():
        (folder / name).write_bytes(data)
    loader = render_loader(folder, [resolve_cache_dir(None)], source_hashes(sources), None)
    (folder / LOADER_FILE).write_bytes(loader)

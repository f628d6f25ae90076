"""Keep the smoke verdict in the checkpoint's state (state["smoke"]), so that doctor and
prestart can tell, without importing torch, that this checkpoint was proven to work."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep import __version__
from qwen_kvprep.journal import Journal
from qwen_kvprep.jsontypes import JSONObject, as_json_object
from qwen_kvprep.state import load_state, state_path, update_state

if TYPE_CHECKING:
    from qwen_kvprep.smoke.evaluate import SmokeSummary

# What a later reader needs; the generated text and log tails stay out of the state.
_KEEP = (
    "ok",
    "device",
    "device_name",
    "torch",
    "torch_cuda",
    "transformers",
    "model_dtype",
    "layers",
    "kernel_layers",
    "kernel_calls",
    "fast_layers",
    "kernel_files",
    "kv_bytes_per_token",
    "tokens_per_s",
    "load_seconds",
    "peak_memory",
    "timed_out",
    "phase",
    "error",
)
_AGREEMENT_KEEP = (
    "tokens",
    "identical_tokens",
    "first_divergence",
    "first_step_max_abs_logit_diff",
    "first_step_rel_logit_diff",
    "max_rel_logit_diff",
)


# A folder with more entries than this is not a checkpoint we can vouch for cheaply.
_MAX_ENTRIES = 10_000


def checkpoint_identity(directory: Path) -> Optional[JSONObject]:
    """{name: [size, mtime_ns]} of the checkpoint's other files (the weights, the
    tokenizer): what the state's sha256 of the files fix owns does not cover. Hashing
    15 GB of weights would cost more than the smoke it spares, and a new revision
    rewrites the files (new size or mtime); None when the folder cannot be listed."""
    from qwen_kvprep.common import TRACKED_FILES

    out: JSONObject = {}
    try:
        with os.scandir(directory) as entries:
            for n, entry in enumerate(entries):
                if n >= _MAX_ENTRIES:
                    return None
                if entry.name.startswith(".") or entry.name in TRACKED_FILES:
                    continue
                if entry.is_file():  # follows a hub snapshot's links to its blobs
                    st = entry.stat()
                    out[entry.name] = [st.st_size, st.st_mtime_ns]
    except OSError:
        return None
    return dict(sorted(out.items()))


def state_entry(summary: SmokeSummary, directory: Optional[Path] = None) -> JSONObject:
    fields: Mapping[str, object] = summary
    entry: dict[str, object] = {k: fields[k] for k in _KEEP if k in fields}
    agreement: Mapping[str, object] = summary.get("agreement") or {}
    if agreement:
        entry["agreement"] = {k: agreement.get(k) for k in _AGREEMENT_KEEP}
    entry["tool_version"] = __version__
    if directory is not None:
        entry["checkpoint_files"] = checkpoint_identity(directory)
    entry["checked"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return as_json_object(entry)


def record_smoke(
    directory: Path, summary: SmokeSummary, journal: Optional[Journal] = None
) -> Optional[Path]:
    """Store the verdict in an existing state.json; returns its path, or None when there is
    no state to update (the checkpoint was never fixed): smoke alone does not create one,
    since prestart trusts a state as "fixed"."""
    if not isinstance(load_state(Path(directory)), dict):
        return None
    if journal is not None:
        if journal.dry_run:
            return None
        update_state(journal, smoke=state_entry(summary, Path(directory)))
        return Path(state_path(Path(directory)))
    # `qwen-kvprep smoke DIR` on its own: take the folder's lock, as fix and revert do
    from qwen_kvprep.buildcache.builder import stderr_notify
    from qwen_kvprep.buildcache.lock import lock_timeout
    from qwen_kvprep.dirlock import folder_lock

    with folder_lock(Path(directory), "qwen-kvprep command", lock_timeout(), stderr_notify):
        if not isinstance(load_state(Path(directory)), dict):
            return None  # reverted meanwhile: nothing to record the verdict in
        update_state(Journal(Path(directory)), smoke=state_entry(summary, Path(directory)))
    return Path(state_path(Path(directory)))


def still_proven(directory: Path, recorded: object) -> Optional[JSONObject]:
    """The recorded smoke verdict when it still proves `directory` works, else None.

    The caller has already found the state (the sha256 of every file fix owns, the build
    key, the modules cache, the packages) unchanged; the verdict must also have passed,
    be for the same other files (the weights), and have run on the kind of device this
    process now sees (a pass on the CPU in a build stage says nothing about the GPU)."""
    from qwen_kvprep.buildcache.arch import visible_gpu_archs

    if not isinstance(recorded, dict) or recorded.get("ok") is not True:
        return None
    if recorded.get("tool_version") != __version__:
        return None
    files = recorded.get("checkpoint_files")
    if files is None or files != checkpoint_identity(directory):
        return None
    device = str(recorded.get("device") or "")
    on_gpu = device.startswith("cuda")
    if on_gpu != bool(visible_gpu_archs()):
        return None
    return as_json_object(recorded)

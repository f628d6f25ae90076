"""Keep the smoke verdict in the checkpoint's state (state["smoke"]), so that doctor and
prestart can tell, without importing torch, that this checkpoint was proven to work."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from qwen_kvprep import __version__
from qwen_kvprep.buildcache.builder import stderr_notify
from qwen_kvprep.buildcache.lock import lock_timeout
from qwen_kvprep.dirlock import folder_lock
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


def state_entry(summary: SmokeSummary) -> JSONObject:
    fields: Mapping[str, object] = summary
    entry: dict[str, object] = {k: fields[k] for k in _KEEP if k in fields}
    agreement: Mapping[str, object] = summary.get("agreement") or {}
    if agreement:
        entry["agreement"] = {k: agreement.get(k) for k in _AGREEMENT_KEEP}
    entry["tool_version"] = __version__
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
        update_state(journal, smoke=state_entry(summary))
        return Path(state_path(Path(directory)))
    # `qwen-kvprep smoke DIR` on its own: take the folder's lock, as fix and revert do

    with folder_lock(Path(directory), "qwen-kvprep command", lock_timeout(), stderr_notify):
        if not isinstance(load_state(Path(directory)), dict):
            return None  # reverted meanwhile: nothing to record the verdict in
        update_state(Journal(Path(directory)), smoke=state_entry(summary))
    return Path(state_path(Path(directory)))

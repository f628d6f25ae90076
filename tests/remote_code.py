"""The checkpoint's remote code and the running transformers, for tests.

`qwen_modeling`: the text of Qwen's own modeling_qwen.py, where the run brings it along.

`code_folder`: where the running transformers runs a local checkpoint's code from, by its
own functions: `transformers_modules/<name>/` (4.x; from 4.5x with the name sanitized) or
`transformers_modules/<name>/<hash>/` (5.x, the hash of the code's bytes), read from the
checkpoint as it is on disk now. Tests compare what qwen-kvprep planted against it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# A folder holding Qwen's own modeling_qwen.py (a Qwen (v1) model repo's remote code at its
# final revision), for the tests that compare against it; they skip where it is unset.
QWEN_CODE_ENV = "QWEN_KVPREP_TEST_QWEN_CODE"


def code_folder(modules: Path, ckpt: Path, name: Optional[str] = None) -> Path:
    """The folder for a load of `ckpt` spelt with the last part `name` (default: its own
    name; "" for a spelling ending in a slash)."""
    from transformers import dynamic_module_utils as dmu

    spelt = ckpt.name if name is None else name
    sanitize = getattr(dmu, "_sanitize_module_name", None)
    if spelt and callable(sanitize):
        spelt = sanitize(spelt)
    folder = modules / "transformers_modules"
    if spelt:
        folder = folder / spelt
    compute = getattr(dmu, "_compute_local_source_files_hash", None)
    if callable(compute):
        folder = folder / compute(str(ckpt), str(ckpt / "modeling_qwen.py"))
    return folder


def transformers_release() -> tuple[int, int]:
    import importlib.metadata

    parts = importlib.metadata.version("transformers").split(".")[:2]
    major, minor = (int("".join(c for c in p if c.isdigit()) or 0) for p in parts)
    return major, minor


def shipped_code_runs() -> bool:
    """Whether Qwen's code as shipped loads on this interpreter: before 4.54, and only where
    transformers_stream_generator imports (transformers' own import check refuses the
    modeling file otherwise, since chat_stream imports it)."""
    from qwen_kvprep.probe.env import package_info

    return transformers_release() < (4, 54) and package_info("transformers_stream_generator").found


def with_compat(ckpt: Path) -> None:
    """The checkpoint's code with qwen-kvprep's compatibility lines and module, as fix
    adds them (and nothing else of fix)."""
    from qwen_kvprep import compat
    from qwen_kvprep.common import COMPAT_FILE
    from qwen_kvprep.resources import templates_dir

    (ckpt / COMPAT_FILE).write_bytes((templates_dir() / COMPAT_FILE).read_bytes())
    model = ckpt / "modeling_qwen.py"
    model.write_text(compat.patched(model.read_text(encoding="utf-8")), encoding="utf-8")


def hashed_folders() -> bool:
    """Whether the running transformers names the folder after the code's hash (5.x)."""
    from transformers import dynamic_module_utils as dmu

    return callable(getattr(dmu, "_compute_local_source_files_hash", None))


def qwen_modeling() -> str:
    """Qwen's own modeling_qwen.py, from the folder QWEN_KVPREP_TEST_QWEN_CODE names; the
    test skips (`needs qwen-code`) where it is unset. A folder named but without the file
    is an error, not a skip."""
    from tests import needs

    folder = os.environ.get(QWEN_CODE_ENV)
    if not folder:
        needs.skip("qwen-code", f"{QWEN_CODE_ENV} names no folder holding it")
    return (Path(folder) / "modeling_qwen.py").read_text(encoding="utf-8")

"""Every change qwen-kvprep makes to a checkpoint goes through a Journal.

The journal keeps each file's original once (bytes, or the link target of a symlink, or the
fact that it did not exist) under `<checkpoint>/.qwen-kvprep/`, and records files planted
outside the checkpoint (the modules cache), so that `revert` can restore the directory
byte for byte. It is saved after every change, so a crash half-way still reverts cleanly.

In dry-run mode nothing is written: the planned writes are collected for display.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from qwen_kvprep.errors import RefusedError
from qwen_kvprep.fsutil import atomic_symlink, atomic_write_bytes, atomic_write_text

STATE_DIRNAME = ".qwen-kvprep"
JOURNAL_FILE = "journal.json"
JOURNAL_VERSION = 1


@dataclass(frozen=True)
class PlannedWrite:
    path: Path
    old: Optional[bytes]  # None: the file does not exist yet
    new: bytes


def _read_current(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class Journal:
    def __init__(self, root: Path, dry_run: bool = False) -> None:
        self.root = Path(root)
        self.dry_run = dry_run
        self.state_dir = self.root / STATE_DIRNAME
        self.planned: list[PlannedWrite] = []
        self._data: dict[str, Any] = self._load()

    # -- persistence -------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        path = self.state_dir / JOURNAL_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"version": JOURNAL_VERSION, "files": {}, "planted": {}}
        except (OSError, ValueError) as exc:
            raise RefusedError(
                f"the journal {path} is unreadable ({exc})",
                fix=f"inspect {path}; remove {self.state_dir} only if you restored the "
                "originals yourself",
            ) from exc
        data.setdefault("files", {})
        data.setdefault("planted", {})
        return data

    def _save(self) -> None:
        if self.dry_run:
            return
        self.state_dir.mkdir(exist_ok=True)
        atomic_write_text(
            self.state_dir / JOURNAL_FILE, json.dumps(self._data, indent=2, sort_keys=True) + "\n"
        )

    @property
    def exists(self) -> bool:
        return (self.state_dir / JOURNAL_FILE).exists()

    @property
    def changed_files(self) -> list[str]:
        return sorted(self._data["files"])

    @property
    def planted_files(self) -> list[str]:
        return sorted(self._data["planted"])

    # -- recording ---------------------------------------------------------------------
    def _original_store(self, key: str) -> Path:
        return self.state_dir / "originals" / hashlib.sha256(key.encode()).hexdigest()[:16]

    def _keep_original(self, table: str, key: str, path: Path) -> None:
        if key in self._data[table] or self.dry_run:
            return
        entry: dict[str, Any]
        if path.is_symlink():
            entry = {"kind": "symlink", "target": os.readlink(path)}
        elif path.exists():
            store = self._original_store(f"{table}:{key}")
            store.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, store)  # copy2 keeps the mode and times
            entry = {"kind": "file", "store": str(store.relative_to(self.state_dir))}
        else:
            entry = {"kind": "absent"}
        self._data[table][key] = entry
        self._save()

    def _write(self, table: str, key: str, path: Path, data: bytes, mode: Optional[int]) -> bool:
        current = None if path.is_symlink() else _read_current(path)
        if current == data:
            return False
        if self.dry_run:
            self.planned.append(PlannedWrite(path, _read_current(path), data))
            return True
        self._keep_original(table, key, path)
        atomic_write_bytes(path, data, mode)
        return True

    def write(self, rel: str, data: bytes, mode: Optional[int] = None) -> bool:
        """Write `<root>/<rel>`, keeping its original once. Returns whether it changed."""
        return self._write("files", rel, self.root / rel, data, mode)

    def plant(self, path: Path, data: bytes) -> bool:
        """Write a file outside the checkpoint (modules cache), recorded for revert."""
        path = Path(path)
        if not self.dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
        return self._write("planted", str(path), path, data, None)

    def record_state_file(self, name: str, text: str) -> None:
        """Write a tool-owned file inside the state folder (removed by revert)."""
        if self.dry_run:
            return
        self.state_dir.mkdir(exist_ok=True)
        atomic_write_text(self.state_dir / name, text)

    # -- undo --------------------------------------------------------------------------
    def _restore(self, table: str, key: str, path: Path) -> str:
        entry = self._data[table][key]
        kind = entry["kind"]
        if kind == "symlink":
            atomic_symlink(entry["target"], path)
            return f"{key} (symlink to {entry['target']})"
        if kind == "file":
            store = self.state_dir / entry["store"]
            with contextlib.suppress(FileNotFoundError):
                if path.is_symlink() or path.exists():
                    os.unlink(path)
            # copy then rename, so a crash leaves either the old or the restored file
            tmp = path.with_name(f".{path.name}.revert")
            shutil.copy2(store, tmp)
            os.replace(tmp, path)
            return key
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return f"{key} (removed: it did not exist before)"

    def revert(self) -> list[str]:
        """Restore every recorded file and remove the state folder. Returns what was done."""
        done: list[str] = []
        for key in sorted(self._data["planted"]):
            done.append(self._restore("planted", key, Path(key)))
        for rel in sorted(self._data["files"]):
            done.append(self._restore("files", rel, self.root / rel))
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self._data = {"version": JOURNAL_VERSION, "files": {}, "planted": {}}
        return done

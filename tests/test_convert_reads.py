"""convert records the bytes it read: a file of DIR replaced or changed while it is read
(or while the proof runs) is said as DIR's change and nothing is published; a staged file
changed after it was read back is not published."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from qwen_kvprep.convert import output, verify, weights
from qwen_kvprep.convert.run import ConvertOptions, convert
from qwen_kvprep.errors import RefusedError
from qwen_kvprep.tiny import generate_checkpoint

SHARD = "model-00001-of-00002.safetensors"
DIR_CHANGED = r"DIR changed while convert read it: model-00001-of-00002\.safetensors \(replaced\)"


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    return generate_checkpoint(tmp_path / "ckpt", shards=2)


def _redownload(ckpt: Path) -> None:
    """What a re-download does: other bytes, renamed over the shard."""
    data = bytearray((ckpt / SHARD).read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    new = ckpt.parent / "downloading"
    new.write_bytes(bytes(data) + b"\0" * 8)
    os.replace(new, ckpt / SHARD)


def _racing(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> None:
    """The shard is replaced once its read has begun (its descriptor open)."""
    real = weights.stream_safetensors

    def racing(path: Path, *args: object, **kwargs: object) -> Iterator[object]:
        stream = real(path, *args, **kwargs)  # type: ignore[arg-type]
        first = next(stream, None)
        if path.name == SHARD:
            _redownload(ckpt)
        if first is not None:
            yield first
        yield from stream

    monkeypatch.setattr(weights, "stream_safetensors", racing)


def _proof(monkeypatch: pytest.MonkeyPatch, ok: bool,
           meanwhile: Callable[[Path], None] = lambda staging: None) -> list[Path]:
    """The proof replaced by one that gives `ok` after `meanwhile(staging)`; returns the
    folders it was run on."""
    ran: list[Path] = []

    def proof(src: Path, staging: Path, **_kw: object) -> object:
        ran.append(staging)
        meanwhile(staging)
        lines = ["ok: the same tokens"] if ok else ["block 0: the hidden states differ"]
        return SimpleNamespace(ok=ok, lines=lines, to_json=lambda: {})

    monkeypatch.setattr(verify, "check_code", lambda directory: None)
    monkeypatch.setattr(verify, "verify", proof)
    return ran


def _nothing_published(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == [], os.listdir(tmp_path)


def test_a_shard_replaced_while_no_verify_reads_it_is_not_recorded_as_read(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _racing(monkeypatch, ckpt)
    out = tmp_path / "out"
    with pytest.raises(RefusedError, match=DIR_CHANGED):
        convert(ckpt, out, ConvertOptions(verify=False))
    _nothing_published(tmp_path, out)


def test_with_the_proof_on_a_changed_dir_is_said_not_blamed_on_the_model(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    # replaced while the weights are read: found before the proof would compare OUT with it
    _racing(monkeypatch, ckpt)
    ran = _proof(monkeypatch, ok=False)
    with pytest.raises(RefusedError, match=DIR_CHANGED) as refused:
        convert(ckpt, out, ConvertOptions())
    assert "behave" not in refused.value.message and not ran
    _nothing_published(tmp_path, out)
    # replaced while the proof runs: the proof's verdict is about other bytes
    monkeypatch.undo()
    again = tmp_path / "again"
    ckpt = generate_checkpoint(again / "ckpt", shards=2)
    ran = _proof(monkeypatch, ok=False, meanwhile=lambda staging: _redownload(ckpt))
    with pytest.raises(RefusedError, match=DIR_CHANGED) as refused:
        convert(ckpt, again / "out", ConvertOptions())
    assert "behave" not in refused.value.message and ran
    _nothing_published(again, again / "out")


def test_a_staged_file_changed_after_its_read_back_is_not_published(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tamper(staging: Path) -> None:
        shard = staging / SHARD
        st = shard.stat()
        with open(shard, "r+b") as fh:
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last[0] ^ 0xFF]))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    ran = _proof(monkeypatch, ok=True, meanwhile=tamper)
    out = tmp_path / "out"
    with pytest.raises(RefusedError, match=rf"a staged file changed after convert read it "
                       rf"back: {SHARD} \(changed\)"):
        convert(ckpt, out, ConvertOptions())
    assert ran and not output.staging_of(out).exists()
    _nothing_published(tmp_path, out)

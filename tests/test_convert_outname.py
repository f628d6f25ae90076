"""The OUT folder convert's advice suggests: never inside a Hub cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen_kvprep.convert.output import check_out
from qwen_kvprep.errors import UsageError


def test_a_snapshot_gets_an_out_outside_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = tmp_path / "hub" / "models--Qwen--Qwen-7B-Chat" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(UsageError) as caught:
        check_out(snap, snap / "out")
    assert caught.value.fix == f"name a folder outside it, e.g. {work / 'Qwen-7B-Chat-qwen2'}"
    # run from inside the cache itself: the home folder instead
    monkeypatch.chdir(snap.parent)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(UsageError) as caught:
        check_out(snap, snap / "out")
    assert caught.value.fix is not None
    assert caught.value.fix.endswith(str(tmp_path / "home" / "Qwen-7B-Chat-qwen2"))


def test_a_plain_folder_gets_its_neighbour(tmp_path: Path) -> None:
    ckpt = tmp_path / "Qwen-7B-Chat"
    ckpt.mkdir()
    with pytest.raises(UsageError) as caught:
        check_out(ckpt, ckpt / "out")
    assert caught.value.fix is not None
    assert caught.value.fix.endswith(str(tmp_path / "Qwen-7B-Chat-qwen2"))

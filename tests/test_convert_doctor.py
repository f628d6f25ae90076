"""`doctor OUT` on a folder convert wrote: recognised by its provenance.json, and judged
against the source it names and against what convert wrote."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.convert.run import ConvertOptions, convert
from qwen_kvprep.probe import converted
from qwen_kvprep.provenance import FileRecord
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import document, invoke


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path]:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2)
    out = tmp_path / "out"
    convert(ckpt, out, ConvertOptions(verify=False))
    return ckpt, out


def _doctor(out: Path) -> dict[str, Any]:
    res = invoke("doctor", str(out), "--json", "--check", "convert.provenance",
                 "--check", "checkpoint.identity")
    doc = document(res)
    return {f["id"]: f for f in doc["findings"]}


def test_a_converted_folder_is_recognised_and_matches(pair: tuple[Path, Path]) -> None:
    ckpt, out = pair
    found = _doctor(out)
    assert found["checkpoint.identity"]["severity"] == "info"
    assert "`qwen-kvprep convert` wrote" in found["checkpoint.identity"]["message"]
    prov = found["convert.provenance"]
    assert prov["severity"] == "ok", prov
    assert f"from {ckpt}: it still matches the source" in prov["message"]
    assert "exact up to 8,192 tokens" in prov["message"]


def test_a_changed_source_weight_fails(pair: tuple[Path, Path]) -> None:
    ckpt, out = pair
    shard = ckpt / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    prov = _doctor(out)["convert.provenance"]
    assert prov["severity"] == "fail"
    assert "the source's weights changed since (model-00002-of-00002.safetensors)" in (
        prov["message"]
    )
    assert f"qwen-kvprep convert {ckpt} NEW_OUT" in prov["fix"]


def test_a_changed_source_config_warns(pair: tuple[Path, Path]) -> None:
    ckpt, out = pair
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["top_p"] = 0.5
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    prov = _doctor(out)["convert.provenance"]
    assert prov["severity"] == "warn" and "generation_config.json changed" in prov["message"]


def test_a_changed_output_fails(pair: tuple[Path, Path]) -> None:
    _, out = pair
    (out / "config.json").write_text((out / "config.json").read_text().replace("1e-06", "1e-05"))
    prov = _doctor(out)["convert.provenance"]
    assert prov["severity"] == "fail"
    assert "config.json in" in prov["message"] and "no longer what convert wrote" in (
        prov["message"]
    )


def test_a_missing_source_warns_and_a_damaged_record_fails(pair: tuple[Path, Path]) -> None:
    ckpt, out = pair
    shutil.rmtree(ckpt)
    prov = _doctor(out)["convert.provenance"]
    assert prov["severity"] == "warn" and "no longer there" in prov["message"]
    damaged = '{"format": 1, "tool": "qwen-kvprep", "source": {"path": 3}}'
    (out / "provenance.json").write_text(damaged)
    prov = _doctor(out)["convert.provenance"]
    assert prov["severity"] == "fail" and "has no source path" in prov["message"]


def test_large_files_are_judged_by_size_and_time_then_by_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(converted, "HASH_LIMIT", 4)
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"0123456789")
    st = f.stat()
    import hashlib

    rec = FileRecord(hashlib.sha256(b"0123456789").hexdigest(), 10, st.st_mtime_ns)
    assert converted.judge(f, f.name, rec).how == "size and modification time"
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # copied: a new time
    assert converted.judge(f, f.name, rec) == converted.FileState(f.name, "same", "sha256")
    f.write_bytes(b"0123456780")
    assert converted.judge(f, f.name, rec).state == "changed"
    f.unlink()
    assert converted.judge(f, f.name, rec).state == "missing"


def _flip_keeping_time(path: Path, offset: int = -1) -> None:
    """One byte of `path` changed, its size and modification time kept (as `touch -r`,
    `cp -p` or bit rot leave them)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_doctor_says_what_it_did_not_read_and_smoke_rehashes_first(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out = pair
    monkeypatch.setattr(converted, "HASH_LIMIT", 1024)  # the shards count as large
    shard = out / "model-00001-of-00002.safetensors"
    assert shard.stat().st_size > 1024
    _flip_keeping_time(shard)
    prov = _doctor(out)["convert.provenance"]
    assert prov["severity"] == "ok"  # the quick look: it says so, and how to look fully
    assert "size and modification time only" in prov["message"]
    assert f"qwen-kvprep smoke {out}" in prov["message"]
    assert "judged by sha256 and size" not in prov["message"]
    from qwen_kvprep.engines import runner

    def no_child(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("an engine child started after the record check failed")

    monkeypatch.setattr(runner, "_run", no_child)
    res = invoke("smoke", str(out), "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    (bad,) = [f for f in document(res)["findings"] if f["severity"] == "fail"]
    assert bad["id"] == "convert.provenance" and shard.name in bad["message"]

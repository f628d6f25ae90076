"""convert at scale: each source byte read once (hashed on the way), each byte of OUT read
back once as it is written and compared with the byte meant to be there, and a line on
stderr for every step."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_kvprep.convert import weights
from qwen_kvprep.convert.compare import check_written
from qwen_kvprep.convert.pieces import Piece
from qwen_kvprep.convert.progress import ConvertLog
from qwen_kvprep.convert.readback import ReadBack
from qwen_kvprep.convert.run import ConvertOptions, convert
from qwen_kvprep.convert.source import SourcePlan, read_source
from qwen_kvprep.convert.weights import BackgroundHash, by_offset, reading_order
from qwen_kvprep.errors import CheckpointError, RefusedError
from qwen_kvprep.probe.checkpoint import probe_checkpoint
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import kvprep

NO_VERIFY = ConvertOptions(verify=False)


def _planned(
    ckpt: Path, tmp_path: Path
) -> tuple[SourcePlan, list[list[Piece]], list[weights.OutShard], Path]:
    """DIR's plan, its pieces in reading order, the output shards and an empty staging
    folder: what write_weights takes."""
    sp = read_source(probe_checkpoint(ckpt))
    groups = by_offset(ckpt, sp.files, reading_order(sp.plan.pieces, sp.file_of, sp.files))
    shards = weights.plan_shards(groups, sp.plan.sources, None)
    staging = tmp_path / "staging"
    staging.mkdir()
    return sp, groups, shards, staging


def test_a_streamed_file_gives_safe_opens_tensors_in_file_order_and_its_sha256(
    tmp_path: Path,
) -> None:
    path = tmp_path / "w.safetensors"
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "a": torch.tensor([1, 2], dtype=torch.int64),
               "c": torch.zeros(0, dtype=torch.bfloat16)}
    save_file(tensors, str(path))
    layout = weights.safetensors_layout(path)
    digest = BackgroundHash()
    got = list(weights.stream_safetensors(path, {"a", "b", "c"}, digest))
    assert [n for n, _ in got] == sorted(layout, key=lambda n: layout[n][2])
    for name, t in got:
        assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name])
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_header_pointing_outside_the_file_is_refused(tmp_path: Path) -> None:
    raw = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)  # 8 of 16 bytes
    with pytest.raises(CheckpointError, match="outside the file"):
        weights.safetensors_layout(path)


def test_the_pieces_are_written_in_the_order_their_tensors_lie_in_the_file(
    tmp_path: Path,
) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2, dtype="fp32")
    sp = read_source(probe_checkpoint(ckpt))
    groups = by_offset(ckpt, sp.files, reading_order(sp.plan.pieces, sp.file_of, sp.files))
    for fname, group in zip(sp.files, groups):
        layout = weights.safetensors_layout(ckpt / fname)
        starts = [layout[p.source][2] for p in group]
        assert starts == sorted(starts) and len(group) > 1
    out = tmp_path / "out"
    convert(ckpt, out, NO_VERIFY)
    for name, t in load_file(str(out / "model-00001-of-00002.safetensors")).items():
        assert t.numel() > 0, name


def test_the_read_back_finds_a_changed_byte_a_short_file_and_a_longer_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shard"
    meant = bytes(range(256)) * 40_000  # more than one read-back chunk
    for on_disk, problem in [
        (meant, None),
        (meant[:9_999] + bytes([meant[9_999] ^ 1]) + meant[10_000:], "byte 9,999 differs"),
        (meant[:-5], "shorter than what was written (at byte 10,239,995)"),
        (meant + b"x", "longer than what was written"),
    ]:
        path.unlink(missing_ok=True)
        readback = ReadBack(window=1 << 20)
        try:
            with open(path, "xb") as fh:
                readback.begin(path)
                fh.write(on_disk)
                fh.flush()
                readback.wrote(meant[:100])
                readback.wrote(memoryview(meant)[100:])
            readback.end(open(path, "ab"))  # noqa: SIM115 (closed by the read-back)
            (got,) = readback.results()
        finally:
            readback.close()
        if problem is None:
            assert got.problems == [] and got.size == len(meant)
            assert got.sha256 == hashlib.sha256(meant).hexdigest()
        else:
            assert len(got.problems) == 1 and problem in got.problems[0], got.problems


def test_the_written_check_finds_a_changed_header_and_a_read_back_problem(
    tmp_path: Path,
) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=1, dtype="fp32")
    sp, groups, shards, staging = _planned(ckpt, tmp_path)
    written = weights.write_weights(ckpt, sp.files, groups, shards, staging)
    shard = staging / shards[0].name
    assert written[0].sha256 == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert check_written(staging, shards, written).ok
    told = [dataclasses.replace(written[0], problems=("model.safetensors differs",))]
    assert check_written(staging, shards, told).problems == ["model.safetensors differs"]
    # the same bytes under a header giving a tensor another shape
    tensors = load_file(str(shard))
    first = shards[0].pieces[0].target
    tensors[first] = tensors[first].reshape(-1)
    save_file(tensors, str(shard))
    result = check_written(staging, shards, written)
    assert len(result.problems) == 1 and result.problems[0].startswith(
        f"{shards[0].name}: {first} is TensorInfo"), result.problems
    assert "planned" in result.problems[0]


def test_a_buffer_is_read_into_again_only_once_the_read_back_compared_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a read-back far behind the writer: were a buffer taken again too early, the bytes
    # compared would be the next tensor's and the check would fail
    slow = ReadBack._compare

    def lagging(self: ReadBack, *args: object) -> None:
        time.sleep(0.01)
        slow(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ReadBack, "_compare", lagging)
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2, dtype="fp32")
    sp, groups, shards, staging = _planned(ckpt, tmp_path)
    taken: list[int] = []
    take = weights.Buffers.take

    def counting(self: weights.Buffers, n: int) -> object:
        taken.append(n)
        return take(self, n)

    monkeypatch.setattr(weights.Buffers, "take", counting)
    written = weights.write_weights(ckpt, sp.files, groups, shards, staging)
    assert len(taken) == sum(len(weights.safetensors_layout(ckpt / f)) for f in sp.files)
    (staging / weights.ST_INDEX).write_bytes(weights.index_json(shards))
    result = check_written(staging, shards, written)
    assert result.ok, result.problems
    for shard in shards:
        mine = load_file(str(staging / shard.name))
        for piece in shard.pieces:
            source = load_file(str(ckpt / sp.file_of[piece.source]))[piece.source]
            assert torch.equal(mine[piece.target], weights.cut(source, piece)), piece.target


def test_a_failed_fsync_of_a_shard_reaches_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2, dtype="fp32")
    sp, groups, shards, staging = _planned(ckpt, tmp_path)
    with pytest.raises(OSError, match="No space left"):
        weights.write_weights(ckpt, sp.files, groups, shards, staging)


def test_a_source_changed_between_planning_and_reading_is_refused(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=1, dtype="fp32")
    sp = read_source(probe_checkpoint(ckpt))
    groups = by_offset(ckpt, sp.files, reading_order(sp.plan.pieces, sp.file_of, sp.files))
    shards = weights.plan_shards(groups, sp.plan.sources, None)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"))
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises((CheckpointError, RefusedError), match="changed while it was read"):
        weights.write_weights(ckpt, sp.files, groups, shards, staging)


def test_counted_steps_say_the_time_left_and_draw_a_bar_on_a_terminal() -> None:
    now = [0.0]
    log = ConvertLog(io.StringIO(), tty=True, clock=lambda: now[0])
    try:
        now[0] = 1.0
        assert log.decorated("proof: running both models block by block") == (
            "proof: running both models block by block")
        now[0] = 11.0
        first = log.decorated("proof: block 1/4")
        assert first == "[#####...............] proof: block 1/4, about 30 s left"
        now[0] = 31.0  # 15 s a block so far
        assert log.decorated("proof: block 2/4").endswith("about 30 s left")
        assert log.decorated("proof: block 4/4").endswith("] proof: block 4/4")
    finally:
        log.close()


def test_the_heartbeat_after_a_finished_shard_speaks_of_the_next_one() -> None:
    now = [0.0]
    stream = io.StringIO()
    log = ConvertLog(stream, tty=False, clock=lambda: now[0])
    try:
        log("shard 1/2 a.safetensors: 10 MB in 1.0 s (10 MB/s)")
        now[0] = 12.0
        deadline = time.monotonic() + 5
        while "still" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        log.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("shard 1/2 a.safetensors: 10 MB in 1.0 s (10 MB/s), about 0 s "
                             "left ...")
    assert lines[1].endswith("still shard 2/2 (12 s)"), lines


def test_json_keeps_stdout_for_the_document_and_quiet_keeps_only_the_result(
    tmp_path: Path,
) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2, dtype="fp32")
    res = kvprep("convert", str(ckpt), str(tmp_path / "out"), "--no-verify", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["compare"]["ok"]
    assert "convert: shard 2/2 model-00002-of-00002.safetensors" in res.stderr
    assert "MB/s" in res.stderr and "checked 2/2" in res.stderr
    res = kvprep("convert", str(ckpt), str(tmp_path / "out2"), "--no-verify", "--quiet")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith("wrote ")

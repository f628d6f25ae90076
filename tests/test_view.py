"""The prepared view (`--output`): links for everything, real files only for what fix
changes, the source never touched, refreshes follow the source, foreign folders refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qwen_kvprep import view
from qwen_kvprep.errors import RefusedError, UsageError
from qwen_kvprep.fsutil import atomic_write_text
from qwen_kvprep.steps.fix import FixOptions, run_fix
from tests.treesnap import snapshot


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    src = tmp_path / "models" / "Qwen-Tiny-Chat"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "qwen"}\n')
    (src / "cpp_kernels.py").write_text("# official loader\n")
    (src / "modeling_qwen.py").write_text("# model code\n")
    (src / "model.safetensors").write_bytes(os.urandom(4096))
    (src / "sub" / "extra.txt").write_text("x")
    blob = tmp_path / "blob"
    blob.write_text("tokenizer blob")
    (src / "qwen.tiktoken").symlink_to(blob)  # like a huggingface_hub snapshot
    return src


def test_view_links_everything_and_records_a_marker(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "prepared" / "Qwen-Tiny-Chat"
    result = view.prepare_view(source, out)
    names = sorted(os.listdir(source))
    assert sorted(result.linked) == names
    for name in names:
        assert (out / name).is_symlink()
        assert os.readlink(out / name) == str(source / name)
    assert (out / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert view.view_mismatch(str(source), str(out)) is None
    marker = json.loads((out / ".qwen-kvprep" / "view.json").read_text())
    assert marker["source"] == str(source)
    assert marker["linked"] == names
    # a second run changes nothing
    again = view.prepare_view(source, out)
    assert not again.changed


def test_the_source_state_folder_is_not_linked(source: Path, tmp_path: Path) -> None:
    (source / ".qwen-kvprep").mkdir()
    out = tmp_path / "out"
    view.prepare_view(source, out)
    assert not (out / ".qwen-kvprep").is_symlink()
    assert (out / ".qwen-kvprep" / "view.json").is_file()


def test_refresh_follows_the_source(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    view.prepare_view(source, out)
    # fix replaces the link of a file it patches with a real file (through the journal)
    atomic_write_text(out / "config.json", '{"model_type": "qwen", "patched": true}\n')
    assert view.view_mismatch(str(source), str(out)) is None

    (source / "new.bin").write_bytes(b"new")
    assert view.view_mismatch(str(source), str(out)) is not None
    result = view.prepare_view(source, out)
    assert result.linked == ["new.bin"]
    assert (out / "config.json").is_file() and not (out / "config.json").is_symlink()

    # the source's config changes: the patched copy is stale and goes back to a link
    (source / "config.json").write_text('{"model_type": "qwen", "v": 2}\n')
    assert "config.json" in (view.view_mismatch(str(source), str(out)) or "")
    result = view.prepare_view(source, out)
    assert result.reset == ["config.json"]
    assert os.readlink(out / "config.json") == str(source / "config.json")

    (source / "new.bin").unlink()
    result = view.prepare_view(source, out)
    assert result.removed == ["new.bin"]
    assert not os.path.lexists(out / "new.bin")
    assert view.view_mismatch(str(source), str(out)) is None


def test_real_files_written_into_the_view_are_kept(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    view.prepare_view(source, out)
    # fix adds the kernel sources when the source has none: not links, and they stay
    (out / "cache_autogptq_cuda_256.cpp").write_text("// ours")
    view.prepare_view(source, out)
    assert (out / "cache_autogptq_cuda_256.cpp").read_text() == "// ours"


def test_refuses_a_foreign_non_empty_folder(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "someones"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RefusedError, match="not empty"):
        view.prepare_view(source, out)
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_view_cut_short_is_claimed_not_foreign(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that finds OUT half-made (another one linking, or a kill half-way) must
    see a view in progress: the claim is written before the first link."""
    from qwen_kvprep import fsutil

    out = tmp_path / "prepared" / "Qwen-Tiny-Chat"
    real_symlink = fsutil.atomic_symlink
    made: list[Path] = []

    def cut_after_two(target: str, link: Path) -> None:
        if len(made) == 2:
            raise KeyboardInterrupt  # the kill
        real_symlink(target, link)
        made.append(link)

    monkeypatch.setattr(fsutil, "atomic_symlink", cut_after_two)
    with pytest.raises(KeyboardInterrupt):
        view.prepare_view(source, out)
    assert len([n for n in os.listdir(out) if n != ".qwen-kvprep"]) == 2
    view.check_output_dir(source, out)  # not refused as someone's folder
    assert "being made" in (view.view_mismatch(str(source), str(out)) or "")
    monkeypatch.undo()
    view.prepare_view(source, out)  # the next run completes it
    assert view.view_mismatch(str(source), str(out)) is None


def test_refuses_a_view_of_another_source(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    view.prepare_view(source, out)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(RefusedError, match="view of"):
        view.prepare_view(other, out)


@pytest.mark.parametrize("name", ["Qwen-1.8B-Chat", "out.d"])
def test_refuses_a_dot_in_the_view_name(source: Path, tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError, match="dot"):
        view.prepare_view(source, tmp_path / name)
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_refuses_overlapping_folders(source: Path, where: str) -> None:
    out = {"same": source, "inside": source / "prepared", "parent": source.parent}[where]
    with pytest.raises(UsageError, match="separate folder"):
        view.check_output_dir(source, out)


def test_fix_dry_run_with_output_creates_nothing(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    target, findings = view.fix_target(source, out, dry_run=True)
    assert target == source
    assert findings[0].id == "checkpoint.view"
    assert not out.exists()


def test_fix_with_output_leaves_the_source_untouched(tmp_path: Path) -> None:
    from qwen_kvprep.tiny import generate_checkpoint

    src = generate_checkpoint(tmp_path / "Tiny-Chat")
    before = snapshot(src, mtimes=True)
    out = tmp_path / "prepared" / "Tiny-Chat"
    # the steps that need torch/transformers/a build are not part of this check
    result = run_fix(src, FixOptions(build=False, smoke=False, output=out))
    assert snapshot(src, mtimes=True) == before
    config = json.loads((out / "config.json").read_text())
    assert config["use_cache_quantization"] is True
    assert not (out / "config.json").is_symlink()
    assert (out / "model.safetensors.index.json").is_symlink()
    assert any(f.id == "checkpoint.view" for f in result.findings)
    # revert of the view restores its links, and still does not touch the source
    from qwen_kvprep.steps.revert import revert_checkpoint

    revert_checkpoint(out)
    assert os.readlink(out / "config.json") == str(src / "config.json")
    assert snapshot(src, mtimes=True) == before

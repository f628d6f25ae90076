from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qwen_kvprep.errors import ConfigError
from qwen_kvprep.steps.config_patch import KV_FLAGS, patch_text
from tests.cli import invoke
from tests.treesnap import snapshot

ORIGINAL = """{
    "architectures": ["QWenLMHeadModel"],
    "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig"},
    "bf16": false,
    "layer_norm_epsilon": 1e-06,
    "model_type": "qwen",
    "use_flash_attn": "auto",
    "zzz_last": [1, 2.5, "\u00e9"]
}
"""


def test_patch_sets_flags_and_keeps_everything_else() -> None:
    new, changed = patch_text(ORIGINAL, Path("config.json"))
    assert changed == ["use_cache_quantization", "use_cache_kernel", "use_flash_attn"]
    before = json.loads(ORIGINAL)
    after = json.loads(new)
    for key, value in before.items():
        if key not in KV_FLAGS:
            assert after[key] == value
    assert after["use_cache_quantization"] is True
    assert after["use_cache_kernel"] is True
    assert after["use_flash_attn"] is False
    # order kept: old keys in their order, new keys appended
    assert list(after)[: len(before)] == list(before)
    assert new.endswith("\n")
    assert '\n    "bf16"' in new  # the file's own indentation is kept


def test_patch_is_idempotent() -> None:
    once, _ = patch_text(ORIGINAL, Path("c.json"))
    twice, changed = patch_text(once, Path("c.json"))
    assert changed == []
    assert twice == once


def test_flag_with_wrong_type_is_corrected() -> None:
    text = '{"use_cache_quantization": 1, "use_cache_kernel": true, "use_flash_attn": false}'
    _, changed = patch_text(text, Path("c.json"))
    assert changed == ["use_cache_quantization"]


def test_invalid_json_names_the_line() -> None:
    bad = '{\n  "a": 1,\n  "b": ,\n}\n'
    with pytest.raises(ConfigError) as err:
        patch_text(bad, Path("config.json"))
    assert "line 3" in err.value.message


def _minimal_checkpoint(tmp_path: Path) -> Path:
    """Enough for the config step; full validation is covered with generated checkpoints."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(ORIGINAL)
    return d


def test_journal_write_replaces_symlink_and_never_touches_blob(tmp_path: Path) -> None:
    from qwen_kvprep.journal.writer import Journal

    blobs = tmp_path / "blobs"
    blobs.mkdir()
    blob = blobs / "abc123"
    blob.write_text(ORIGINAL)
    d = tmp_path / "snap"
    d.mkdir()
    os.symlink("../blobs/abc123", d / "config.json")
    j = Journal(d)
    new, _ = patch_text(ORIGINAL, d / "config.json")
    assert j.write("config.json", new.encode())
    assert not (d / "config.json").is_symlink()
    assert blob.read_text() == ORIGINAL
    restored = Journal(d).revert()
    assert restored and "symlink" in restored[0]
    assert os.readlink(d / "config.json") == "../blobs/abc123"
    assert not (d / ".qwen-kvprep").exists()


def test_journal_revert_is_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qwen_kvprep.journal.writer import Journal

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    d = _minimal_checkpoint(tmp_path)
    os.chmod(d / "config.json", 0o640)
    outside = tmp_path / "modules" / "x" / "cache_autogptq_cuda_256.cpp"
    before = snapshot(d)
    j = Journal(d)
    j.write("config.json", b"{}\n")
    j.write("config.json", b'{"second": true}\n')  # the first original is the one kept
    j.write("new_file.py", b"print(1)\n")
    j.plant(outside, b"// planted\n")
    assert outside.exists()
    Journal(d).revert()
    assert snapshot(d) == before
    assert not outside.exists()


def test_journal_dry_run_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen_kvprep.journal.writer import Journal

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "elsewhere"))
    d = _minimal_checkpoint(tmp_path)
    before = snapshot(d)
    j = Journal(d, dry_run=True)
    assert j.write("config.json", b"{}\n")
    assert j.plant(tmp_path / "elsewhere" / "x" / "cpp_kernels.py", b"x")
    assert [p.path.name for p in j.planned] == ["config.json", "cpp_kernels.py"]
    assert snapshot(d) == before
    assert not (tmp_path / "elsewhere").exists()


def test_revert_without_journal_says_nothing_to_do(tmp_path: Path) -> None:
    d = _minimal_checkpoint(tmp_path)
    res = invoke("revert", str(d))
    assert res.returncode == 0
    assert "nothing to revert" in res.stdout


def test_dry_run_rendering_diffs_small_files_and_summarises_large_ones(tmp_path: Path) -> None:
    from qwen_kvprep.journal.writer import PlannedWrite
    from qwen_kvprep.render import render_planned

    new_cfg, _ = patch_text(ORIGINAL, tmp_path / "config.json")
    text = render_planned(
        [
            PlannedWrite(tmp_path / "config.json", ORIGINAL.encode(), new_cfg.encode()),
            PlannedWrite(tmp_path / "cpp_kernels.py", b"old loader\n", b"#" * 8000),
            PlannedWrite(tmp_path / "k.cu", None, b"x" * 9000),
        ]
    )
    assert '+    "use_cache_quantization": true' in text
    assert '-    "use_flash_attn": "auto",' in text
    assert f"would replace {tmp_path / 'cpp_kernels.py'} (11 -> 8000 bytes)" in text
    assert f"would create {tmp_path / 'k.cu'} (9000 bytes)" in text

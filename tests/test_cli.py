"""The CLI contract: exit codes, --json shape, no traceback for expected failures."""

from __future__ import annotations

import json
from pathlib import Path

from qwen_kvprep import __version__
from tests.cli import kvprep


def test_version() -> None:
    res = kvprep("--version")
    assert res.returncode == 0
    assert __version__ in res.stdout


def test_unknown_option_is_usage_error() -> None:
    res = kvprep("doctor", "--no-such-option")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr


def test_missing_directory_is_usage_error(tmp_path: Path) -> None:
    for cmd in (["doctor"], ["fix"], ["revert"]):
        res = kvprep(*cmd, str(tmp_path / "nope"))
        assert res.returncode == 2, (cmd, res.stderr)
        assert "no such directory" in res.stderr
        assert "Traceback" not in res.stderr


def test_unknown_check_id_is_usage_error() -> None:
    res = kvprep("doctor", "--check", "env.no_such_check")
    assert res.returncode == 2
    assert "--list-checks" in res.stderr


def test_fix_refuses_invalid_config_without_traceback(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text('{\n  "model_type": "qwen",\n  oops\n}\n')
    before = (d / "config.json").read_bytes()
    res = kvprep("fix", str(d), "--no-build", "--no-smoke")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert (d / "config.json").read_bytes() == before


def test_json_error_document_is_one_object(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{ broken")
    res = kvprep("fix", str(d), "--no-build", "--no-smoke", "--json")
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["schema_version"] == 1
    assert doc["tool_version"] == __version__
    assert doc["ok"] is False
    for f in doc["findings"]:
        assert set(f) >= {"id", "severity", "message", "fix", "paths"}

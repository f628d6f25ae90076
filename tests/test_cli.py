"""The CLI contract: exit codes, --json shape, no traceback for expected failures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qwen_kvprep import __version__
from tests.cli import invoke, kvprep


def test_version() -> None:
    res = kvprep("--version")
    assert res.returncode == 0
    assert __version__ in res.stdout


def test_version_names_the_stack_without_importing_torch() -> None:
    """What a bug report needs, from the packages' metadata: torch is never imported."""
    import importlib.metadata
    import platform
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from qwen_kvprep.entry import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported', code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    versions = [f"qwen-kvprep {__version__} ("] + [
        f"{name} {importlib.metadata.version(name)}"
        for name in ("torch", "transformers", "huggingface-hub")
    ] + [f"Python {platform.python_version()})"]
    assert all(v in out for v in versions), out
    assert out.splitlines()[-1] == "torch not imported 0", out


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


@pytest.mark.parametrize(
    "args",
    [
        ["doctor", "--json", "--no-such-option"],  # click stops before it reads --json
        ["doctor", "--no-such-option", "--json"],
        ["--json", "no-such-command"],
        ["smoke", "DIR", "--json", "--max-new-tokens", "0"],
        ["template", "--json"],
        ["plan", "DIR", "--json", "--prompt-tokens", "0"],
    ],
)
def test_usage_errors_with_json_are_one_document(tmp_path: Path, args: list[str]) -> None:
    args = [str(tmp_path) if a == "DIR" else a for a in args]
    res = kvprep(*args)
    assert res.returncode == 2, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["error"]["message"], doc
    assert "--help" in doc["error"]["fix"]
    assert res.stderr == ""


@pytest.mark.parametrize(
    "args", [["doctor", "--no-such-option", "--json"], ["template", "k8s"]]
)
def test_a_reader_that_went_away_gets_no_traceback(args: list[str]) -> None:
    # `qwen-kvprep ... | head -1`: stdout is a pipe whose reader has closed it
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "qwen_kvprep", *args], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert res.returncode == 1 and res.stderr == "", res.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["fix", "DIR", "-o", ""],  # it fixed DIR in place, or made the current folder a view
        ["fix", "DIR", "--prebuilt", ""],  # it compiled instead
        ["prestart", "DIR", "-o", "", "--", "true"],
        ["prestart", "DIR", "--cache-dir", " ", "--", "true"],
        ["build", "--fetch", ""],  # it ran an ordinary build
        ["build", "--lock", ""],
        ["build", "--export", ""],  # it wrote ./build/<variant>
        ["build", "--lock", "org/name", "--lock-file", ""],
        ["template", "docker", "-o", ""],
    ],
)
def test_an_empty_value_is_a_usage_error_not_the_option_left_out(
    tmp_path: Path, args: list[str]
) -> None:
    # what an unset shell variable gives: `--fetch "$LOCK"`
    (tmp_path / "DIR").mkdir()
    (tmp_path / "cwd").mkdir()
    args = [str(tmp_path / "DIR") if a == "DIR" else a for a in args]
    res = kvprep(*args, cwd=tmp_path / "cwd")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "must not be empty" in res.stderr and "Traceback" not in res.stderr
    assert not list((tmp_path / "cwd").iterdir()) and not list((tmp_path / "DIR").iterdir())


def test_json_after_the_command_s_dashes_is_the_command_s(tmp_path: Path) -> None:
    res = kvprep("prestart", str(tmp_path), "--no-such", "--", "serve", "--json")
    assert res.returncode == 2 and res.stdout == "" and "No such option" in res.stderr


@pytest.mark.parametrize(
    ("text", "line", "said"),
    [
        ('{\n  "model_type": "qwen",\n  "hidden_size": 4096\n  "num_layers": 2\n}\n', 3,
         "missing ','"),
        ('{\n  "model_type": "qwen",\n  "hidden_size": 4096,\n\n\n}\n', 3, "trailing ','"),
        ('{\n  "model_type": "qwen",\n  "a": [1, 2,\n  ]\n}\n', 3, "trailing ','"),
        ('{\n  "model_type": "qwen",\n  "hidden_size": 40\n\n', 3, "cut off"),
        ('{"model_type": "qwen",\n oops}\n', 2, "Expecting property name"),
    ],
)
def test_bad_json_is_reported_at_the_line_to_fix(
    tmp_path: Path, text: str, line: int, said: str
) -> None:
    """The parser stops past a missing or trailing comma (often lines later): the message
    points where the fix goes, in plan, fix and doctor alike."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(text)
    res = invoke("plan", str(d), "--gpu", "h100")
    assert res.returncode == 1 and said in res.stderr, res.stderr
    assert f"at line {line}," in res.stderr and f"repair line {line} " in res.stderr
    # in this process: a child would import torch (doctor probes it) for a parse message
    res = invoke("doctor", str(d), "--check", "config.parse", "--json")
    (finding,) = json.loads(res.stdout)["findings"]
    assert f"at line {line}," in finding["message"], finding


@pytest.mark.parametrize("arch", ["abc", "8", "amperes", ";;"])
@pytest.mark.parametrize("command", [["build"], ["fix", "DIR"], ["prestart", "DIR", "--", "true"]])
def test_an_unreadable_arch_is_a_usage_error_on_any_torch(
    tmp_path: Path, command: list[str], arch: str
) -> None:
    """Checked as the options are read, also where a CPU torch builds no architectures
    (these tests' torch): a typo in an image build fails there, not on the first GPU."""
    args = [str(tmp_path) if a == "DIR" else a for a in command]
    res = invoke(*args[:2], "--arch", arch, *args[2:])
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: --arch: "), res.stderr
    assert '"8.0;9.0+PTX"' in res.stderr  # the fix shows a list that works
    assert list(tmp_path.iterdir()) == []


def test_prestart_names_the_variable_an_unreadable_arch_came_from(tmp_path: Path) -> None:
    import os

    res = kvprep("prestart", str(tmp_path), "--", "true",
                 env={**os.environ, "QWEN_KVPREP_ARCH": "sm80;9.0"})
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("error: QWEN_KVPREP_ARCH: 'sm80' is not a GPU architecture")


@pytest.mark.parametrize("command", ["build", "fix", "prestart"])
def test_cache_dir_help_names_the_folders_the_cache_resolves_to(command: str) -> None:
    """--help names each place the build cache is taken from, in common.build_cache_root's
    order: the variable, $XDG_CACHE_HOME's folder, then the home one."""
    res = invoke(command, "--help")
    text = " ".join(re.sub(r"-\n\s+", "-", res.stdout).split())  # click breaks at hyphens
    assert "$QWEN_KVPREP_CACHE, else $XDG_CACHE_HOME/qwen-kvprep, else ~/.cache/qwen-kvprep" \
        in text, text


@pytest.mark.parametrize("command", ["build", "fix", "prestart"])
@pytest.mark.parametrize(
    "arch", ["8.0;9.0+PTX", "8.0 9.0a", "sm_80,8.6+ptx", "Ampere", "ampere;HOPPER", ""]
)
def test_every_arch_build_reads_is_taken(command: str, arch: str) -> None:
    """What worked before still parses: torch's lists and names, qwen-kvprep's spellings
    (sm_80, commas), and a blank list, which means none given."""
    from qwen_kvprep.cli import cli

    args = ["--arch", arch] if command == "build" else ["DIR", "--arch", arch]
    ctx = cli.commands[command].make_context(command, args)
    assert ctx.params["arch"] == arch


@pytest.mark.parametrize("args", [
    ("fix", "DIR", "--smoke-timeout"),
    ("demo", "--smoke-timeout"),
    ("profile", "DIR", "--timeout"),
    ("smoke", "DIR", "--timeout"),
], ids=lambda a: " ".join(a))
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_seconds_that_are_not_numbers_are_usage_errors(
    tmp_path: Path, args: tuple[str, ...], value: str
) -> None:
    """nan passes every comparison of a range and inf reads as no limit: both refused at
    the option, before DIR is even looked at."""
    argv = [str(tmp_path / "absent") if a == "DIR" else a for a in args]
    res = invoke(*argv, value)
    assert res.returncode == 2, res.stderr
    assert args[-1] in res.stderr and "not a finite number" in res.stderr, res.stderr

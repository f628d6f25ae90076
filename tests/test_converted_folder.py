"""A folder `convert` wrote, handed to the other commands: fix refuses it before any write
and says how to serve it, prestart starts the command on it as it is, doctor shows only
what applies to it, convert names it as already converted, and the same convert into its
complete OUT again is a no-op."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from qwen_kvprep.convert.run import ConvertOptions, convert
from qwen_kvprep.convert.serving import vllm_launch
from qwen_kvprep.tiny import generate_checkpoint
from tests.cli import document, invoke, kvprep
from tests.treesnap import snapshot

pytestmark = pytest.mark.usefixtures("isolated_hf")


@pytest.fixture()
def pair(tmp_path: Path) -> tuple[Path, Path]:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2)
    out = tmp_path / "out"
    convert(ckpt, out, ConvertOptions(verify=False))
    return ckpt, out


def _modules(home: Path) -> list[str]:
    root = home / "modules"
    return sorted(str(p) for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("dry_run", [True, False])
def test_fix_refuses_a_converted_folder_before_any_write(
    pair: tuple[Path, Path], isolated_hf: Path, dry_run: bool
) -> None:
    ckpt, out = pair
    before = snapshot(out, mtimes=True)
    res = invoke("fix", *(["--dry-run"] if dry_run else []), "--no-build", str(out))
    assert res.returncode != 0, res.stdout + res.stderr
    text = res.stdout + res.stderr
    assert f"{out} is a Qwen2 checkpoint that `qwen-kvprep convert` wrote from {ckpt}" in text
    assert "it is already converted" in text
    # the first serving line: without calibrated KV scales, vLLM's unquantized cache
    vllm = vllm_launch(shlex.quote(str(out)))
    assert f"`{vllm} --max-model-len 8192 --dtype bfloat16` (convert printed" in text
    assert f"qwen-kvprep doctor {out}" in text
    assert "modeling_qwen.py" not in text and "HF_MODULES_CACHE" not in text
    assert snapshot(out, mtimes=True) == before
    assert _modules(isolated_hf) == []


def test_fix_output_of_a_converted_folder_refuses_and_makes_nothing(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    _ckpt, out = pair
    view = tmp_path / "view"
    res = invoke("fix", "--no-build", "--output", str(view), str(out))
    assert res.returncode != 0
    assert "it is already converted" in res.stderr
    assert not os.path.lexists(view)


def test_prestart_starts_the_command_on_a_converted_folder(
    pair: tuple[Path, Path], isolated_hf: Path, tmp_path: Path
) -> None:
    ckpt, out = pair
    before = snapshot(out, mtimes=True)
    view = tmp_path / "view"
    for extra in ((), ("--output", str(view))):
        res = kvprep("prestart", str(out), *extra, "--", "sh", "-c", "echo served; exit 7")
        assert res.returncode == 7, res.stderr  # CMD's own exit code
        assert res.stdout == "served\n"
        lines = res.stderr.splitlines()
        assert len(lines) == 1, res.stderr  # one line: why nothing was prepared
        assert lines[0].startswith(f"qwen-kvprep prestart: {out} is a Qwen2 checkpoint")
        assert f"wrote from {ckpt}" in lines[0] and "nothing was prepared" in lines[0]
    assert f"{view} was not made: serve {out} itself" in lines[0]
    assert not os.path.lexists(view)
    assert snapshot(out, mtimes=True) == before
    assert _modules(isolated_hf) == []


def test_prestart_json_on_a_converted_folder_prepared_nothing(pair: tuple[Path, Path]) -> None:
    _ckpt, out = pair
    res = kvprep("prestart", str(out), "--json", "--", "sh", "-c", "exit 3")
    assert res.returncode == 3
    doc = json.loads(res.stdout.splitlines()[0])
    assert doc["ok"] is True
    assert doc["prestart"]["prepared"] is None and doc["prestart"]["fallback"] is False
    assert "nothing was prepared" in doc["findings"][0]["message"]


def test_convert_names_a_converted_folder_given_as_dir(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, out = pair
    res = invoke("convert", str(out), str(tmp_path / "out2"), "--no-verify")
    assert res.returncode != 0
    assert f"{out} is a Qwen2 checkpoint that `qwen-kvprep convert` wrote from {ckpt}" in (
        res.stderr
    )
    assert "it is already converted" in res.stderr
    assert "num_attention_heads" not in res.stderr and "kv_channels" not in res.stderr
    assert not os.path.lexists(tmp_path / "out2")


def test_doctor_shows_only_what_applies_to_a_converted_folder(pair: tuple[Path, Path]) -> None:
    _ckpt, out = pair
    doc = document(invoke("doctor", str(out), "--json"))
    found = {f["id"]: f["severity"] for f in doc["findings"]}
    assert found == {"checkpoint.identity": "info", "convert.provenance": "ok"}
    # a check asked for by name still runs
    doc = document(invoke("doctor", str(out), "--json", "--check", "kernels.sources"))
    assert [f["id"] for f in doc["findings"]] == ["kernels.sources"]


def test_the_same_convert_again_is_a_no_op(pair: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, out = pair
    before = snapshot(out, mtimes=True)
    res = invoke("convert", str(ckpt), str(out), "--no-verify", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["unchanged"] is True
    assert any(f["id"] == "convert.unchanged" for f in doc["findings"])
    assert doc["serving"] and str(out) in doc["serving"][0]["command"]
    # the same folder spelt through a link is the same DIR (judged by device and inode)
    link = tmp_path / "ckpt-link"
    link.symlink_to(ckpt)
    res = invoke("convert", str(link), str(out), "--no-verify")
    assert res.returncode == 0, res.stderr
    assert "nothing was written" in " ".join(res.stdout.split())  # lines are wrapped
    assert snapshot(out, mtimes=True) == before


def test_a_conversion_that_differs_is_still_refused_and_says_why(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, out = pair
    res = invoke("convert", str(ckpt), str(out))  # asks for the verification it skipped
    assert res.returncode == 2
    assert "exists and is not empty" in res.stderr
    assert "it was converted with --no-verify" in res.stderr
    res = invoke("convert", str(ckpt), str(out), "--no-verify", "--max-shard-size", "1MB")
    assert res.returncode == 2
    assert "without --max-shard-size" in res.stderr
    other = generate_checkpoint(tmp_path / "other", shards=2)
    res = invoke("convert", str(other), str(out), "--no-verify")
    assert res.returncode == 2 and f"it was converted from {ckpt}, not from {other}" in (
        res.stderr
    )
    gen = ckpt / "generation_config.json"
    gen.write_text(gen.read_text().replace("{", '{"top_k": 3,', 1))
    res = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert res.returncode == 2
    assert "DIR's files changed since: generation_config.json (changed)" in res.stderr


FOREIGN = '{"generated_by": "someone else\'s pipeline", "format": 1}\n'


def test_a_foreign_provenance_json_is_named_and_otherwise_ignored(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, out = pair
    # a Qwen (v1) checkpoint holding another tool's provenance.json: judged as any other
    (ckpt / "provenance.json").write_text(FOREIGN)
    res = invoke("doctor", str(ckpt), "--json", "--check", "convert.provenance",
                 "--check", "checkpoint.identity")
    found = {f["id"]: f for f in document(res)["findings"]}
    assert found["convert.provenance"]["severity"] == "info", found
    assert "is not a record qwen-kvprep convert wrote" in found["convert.provenance"]["message"]
    assert found["checkpoint.identity"]["severity"] == "ok", found
    res = invoke("smoke", str(ckpt), "--engine", "vllm")
    assert res.returncode == 2 and "a provenance.json that is not convert's" in res.stderr
    # a Qwen2 folder holding one is not a folder convert wrote
    (out / "provenance.json").write_text(FOREIGN)
    res = invoke("fix", "--no-build", str(out))
    assert res.returncode != 0
    assert "wrote from" not in res.stderr and "another tool's" in res.stderr, res.stderr
    res = kvprep("prestart", str(out), "--", "sh", "-c", "exit 0")
    assert "wrote from" not in res.stderr and "another tool's" in res.stderr, res.stderr


def test_every_input_counts_for_the_same_convert_again(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "ckpt", shards=2)
    gen = (ckpt / "generation_config.json").read_bytes()
    (ckpt / "generation_config.json").unlink()  # optional: a base model may lack it
    out = tmp_path / "out"
    convert(ckpt, out, ConvertOptions(verify=False))
    source = json.loads((out / "provenance.json").read_text())["source"]
    assert "generation_config.json" in source["absent"]  # considered, and absent
    assert (source["device"], source["inode"]) == (ckpt.stat().st_dev, ckpt.stat().st_ino)
    assert invoke("convert", str(ckpt), str(out), "--no-verify").returncode == 0
    # DIR gains it: a fresh convert would write another OUT (chat template, eos ids)
    (ckpt / "generation_config.json").write_bytes(gen)
    res = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert res.returncode == 2, res.stdout
    assert "generation_config.json (changed)" in res.stderr
    (ckpt / "generation_config.json").unlink()
    # an extra folder in OUT is not what convert wrote
    (out / "extra").mkdir()
    res = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert res.returncode == 2 and "files convert did not write: extra" in res.stderr
    (out / "extra").rmdir()
    # the same folder is the one recorded by device and inode, wherever it is now ...
    moved = tmp_path / "moved"
    ckpt.rename(moved)
    res = invoke("convert", str(moved), str(out), "--no-verify")
    assert res.returncode == 0, res.stderr
    # ... and another folder put at the recorded path is not it, however alike
    os.mkdir(ckpt)
    for path in moved.iterdir():
        os.link(path, ckpt / path.name)  # the very files, in another folder
    res = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert res.returncode == 2
    assert f"it was converted from {ckpt} (another folder than the one there now)" in res.stderr


def test_a_record_without_absent_inputs_or_dir_identity_still_serves(
    pair: tuple[Path, Path]
) -> None:
    ckpt, out = pair  # as an older release wrote it: every input DIR had is in `files`
    rec = json.loads((out / "provenance.json").read_text())
    for key in ("absent", "device", "inode"):
        del rec["source"][key]
    (out / "provenance.json").write_text(json.dumps(rec))
    res = invoke("convert", str(ckpt), str(out), "--no-verify")
    assert res.returncode == 0 and "kept" in res.stdout, res.stderr
    doc = document(invoke("doctor", str(out), "--json"))
    assert {f["id"]: f["severity"] for f in doc["findings"]}["convert.provenance"] == "ok"
    (ckpt / "extra_input").write_text("")  # not an input: nothing to say
    assert invoke("convert", str(ckpt), str(out), "--no-verify").returncode == 0

"""`convert DIR OUT --kv-cache fp8`: calibrated fp8 KV scales written as llm-compressor writes
them, measured independently here, the weights untouched, added in place to a plain OUT,
and judged by the CPU reference on the fixture whose K and V run past fp8's range."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from qwen_kvprep.convert.run import ConvertOptions, convert, summary
from qwen_kvprep.errors import UsageError
from qwen_kvprep.kvcal import reference, scales, text
from qwen_kvprep.kvjudge.passage import PASSAGE
from qwen_kvprep.kvjudge.verdict import usable, why_unusable
from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.cli import document, invoke
from tests.kv_fixture import push_kv_out_of_fp8_range
from tests.remote_code import transformers_release

FP8 = ConvertOptions(verify=False, kv_cache="fp8")


def _needs_stack() -> None:
    if transformers_release() < (4, 37):
        needs.skip("transformers-4.37", "this transformers has no Qwen2ForCausalLM")


@pytest.fixture()
def pushed(tmp_path: Path) -> Path:
    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", shards=2)
    push_kv_out_of_fp8_range(ckpt)
    return ckpt


def _whole_model_absmax(out: Path, rows: list[list[int]]) -> list[tuple[float, float]]:
    """K and V as transformers' own cache holds them after a whole-model forward of each row
    (no block-by-block pass): the independent measurement of what calibration records."""
    model = reference._load(out)
    found: dict[int, tuple[float, float]] = {}
    for row in rows:
        cache = reference._cache(None)
        with torch.inference_mode():
            model(input_ids=torch.tensor([row]), past_key_values=cache, use_cache=True)
        for i in range(model.config.num_hidden_layers):
            layer: Any = cache.layers[i] if hasattr(cache, "layers") else None
            k = layer.keys if layer is not None else cache.key_cache[i]
            v = layer.values if layer is not None else cache.value_cache[i]
            a, b = found.get(i, (0.0, 0.0))
            found[i] = (max(a, float(k.abs().max())), max(b, float(v.abs().max())))
    return [found[i] for i in sorted(found)]


def test_scales_are_absmax_over_448_in_llm_compressors_shape(pushed: Path, tmp_path: Path) -> None:
    _needs_stack()
    out = convert(pushed, tmp_path / "out", FP8).out
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"] == {}
    assert {k: q["kv_cache_scheme"][k] for k in
            ("num_bits", "type", "strategy", "dynamic", "symmetric")} == {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
        "symmetric": True}
    index = json.loads((out / scales.INDEX).read_text())["weight_map"]
    from safetensors.torch import load_file

    tensors = load_file(str(out / scales.SCALES_FILE))
    layers = config["num_hidden_layers"]
    assert sorted(tensors) == sorted(
        f"model.layers.{i}.self_attn.{w}_scale" for i in range(layers) for w in "kv")
    assert all(index[n] == scales.SCALES_FILE for n in tensors)
    # llm-compressor's shape: one-element float32 tensors
    assert all(t.dtype == torch.float32 and t.shape == (1,) for t in tensors.values())
    cal = text.default_calibration(text.tokenizer_of(out))
    assert len(cal.tokens) == text.CALIBRATION_TOKENS
    want = _whole_model_absmax(out, cal.rows())
    for i, (k, v) in enumerate(want):
        assert k > 448 and v > 448  # the fixture's K and V are past fp8's range
        assert float(tensors[f"model.layers.{i}.self_attn.k_scale"]) == pytest.approx(
            k / 448, rel=1e-5)
        assert float(tensors[f"model.layers.{i}.self_attn.v_scale"]) == pytest.approx(
            v / 448, rel=1e-5)
    rec = json.loads((out / "provenance.json").read_text())["kv_cache"]
    assert rec["calibration"] == {"text": text.DEFAULT_NAME, "sha256": cal.sha256,
                                  "tokens": text.CALIBRATION_TOKENS}
    assert rec["k_scale"] == [float(tensors[f"model.layers.{i}.self_attn.k_scale"])
                              for i in range(layers)]


def _weight_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("model*.safetensors"))}


def test_weights_stay_bit_for_bit_the_plain_conversions(pushed: Path, tmp_path: Path) -> None:
    _needs_stack()
    plain = convert(pushed, tmp_path / "plain", ConvertOptions(verify=False)).out
    calibrated = convert(pushed, tmp_path / "calibrated", FP8).out
    assert _weight_files(plain) == _weight_files(calibrated)
    assert (calibrated / scales.SCALES_FILE).is_file()


def test_added_in_place_to_a_plain_out_then_a_no_op(pushed: Path, tmp_path: Path) -> None:
    _needs_stack()
    out = tmp_path / "out"
    convert(pushed, out, ConvertOptions(verify=False))
    before = {p.name: os.stat(p) for p in out.glob("model*.safetensors")}
    added = convert(pushed, out, FP8)
    assert not added.unchanged and added.kv_cache is not None
    after = {p.name: os.stat(p) for p in out.glob("model*.safetensors")}
    # the weights were not written again: the same files, the same inodes and times
    assert {n: (s.st_ino, s.st_mtime_ns) for n, s in before.items()} == {
        n: (s.st_ino, s.st_mtime_ns) for n, s in after.items()}
    record = (out / "provenance.json").read_bytes()
    again = convert(pushed, out, FP8)
    assert again.unchanged and (out / "provenance.json").read_bytes() == record
    assert any("kept calibrated fp8 KV cache scales" in line for line in summary(again))
    found = {f["id"]: f for f in document(invoke(
        "doctor", str(out), "--json", "--check", "convert.provenance"))["findings"]}
    prov = found["convert.provenance"]
    assert prov["severity"] == "ok", prov
    assert f"calibrated on {text.CALIBRATION_TOKENS} tokens" in prov["message"]


def test_a_single_shard_out_gets_an_index_naming_every_tensor(tmp_path: Path) -> None:
    _needs_stack()
    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", shards=1)
    out = convert(ckpt, tmp_path / "out", FP8).out
    index = json.loads((out / scales.INDEX).read_text())
    weight_map = index["weight_map"]
    assert set(weight_map.values()) == {"model.safetensors", scales.SCALES_FILE}
    from safetensors import safe_open

    held: dict[str, str] = {}
    size = 0
    for name in set(weight_map.values()):
        with safe_open(str(out / name), framework="pt") as fh:
            for t in fh.keys():  # noqa: SIM118
                held[t] = name
                size += fh.get_tensor(t).numel() * fh.get_tensor(t).element_size()
    assert held == weight_map and index["metadata"]["total_size"] == size


def test_a_calibration_file_too_short_is_refused_before_anything_is_written(
        pushed: Path, tmp_path: Path) -> None:
    _needs_stack()  # calibration tokenizes with the converted tokenizer (tokenizers 0.15 on)
    short = tmp_path / "short.txt"
    short.write_text("Hello there.")
    with pytest.raises(UsageError, match="too short to calibrate"):
        convert(pushed, tmp_path / "out", ConvertOptions(
            verify=False, kv_cache="fp8", calibration=short))
    assert not (tmp_path / "out").exists()


def test_a_jsonl_calibration_file_is_read_by_its_text_fields(tmp_path: Path) -> None:
    path = tmp_path / "cal.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"line {i} " + PASSAGE, "id": i})
                              for i in range(3)) + "\n")
    body, _sha = text.read_calibration_file(path)
    assert body.startswith("line 0 A key-value cache") and "line 2" in body
    path.write_text('{"id": 1}\n')
    with pytest.raises(UsageError, match='no "text" string'):
        text.read_calibration_file(path)


def test_gptq_and_a_lone_calibration_are_refused(tmp_path: Path) -> None:
    ckpt = generate_checkpoint(tmp_path / "Tiny-Int4", gptq=True, shards=1)
    with pytest.raises(UsageError, match="GPTQ"):
        convert(ckpt, tmp_path / "out", FP8)
    with pytest.raises(UsageError, match="add --kv-cache fp8"):
        convert(ckpt, tmp_path / "out", ConvertOptions(calibration=tmp_path / "x.txt"))
    assert not (tmp_path / "out").exists()


def _rows(out: Path) -> tuple[Any, Any]:
    ids = text.passage_ids(text.tokenizer_of(out), 512)
    unit = reference.measure(out, ids, reference.CacheMode("fp8_e4m3", "1.0"))
    calibrated = reference.measure(out, ids, reference.CacheMode("fp8_e4m3", "checkpoint"))
    return unit, calibrated


@pytest.mark.slow
def test_the_fixture_at_scale_one_is_broken_and_calibrated_usable(
        pushed: Path, tmp_path: Path) -> None:
    _needs_stack()
    if getattr(torch, "float8_e4m3fn", None) is None:
        needs.skip("torch-float8", f"torch {torch.__version__} has no float8_e4m3fn")
    out = convert(pushed, tmp_path / "out", FP8).out
    unit, calibrated = _rows(out)
    assert unit.tokens_scored == calibrated.tokens_scored == 511
    assert not usable(unit), unit
    assert usable(calibrated), why_unusable(calibrated)
    assert calibrated.kl_mean * 10 <= unit.kl_mean


def test_the_cli_takes_kv_cache_and_reports_it(pushed: Path, tmp_path: Path) -> None:
    _needs_stack()
    cal = tmp_path / "cal.txt"
    cal.write_text(PASSAGE * 4)
    res = invoke("convert", str(pushed), str(tmp_path / "out"), "--no-verify", "--kv-cache",
                 "fp8", "--calibration", str(cal), "--json", "--quiet")
    doc = document(res)
    assert doc["kv_cache"]["calibration"]["text"] == str(cal)
    assert doc["serving"][0]["engine"].startswith("vLLM (fp8 KV cache, OUT's calibrated")
    shutil.rmtree(tmp_path / "out")


def test_serving_lines_say_where_the_fp8_scales_come_from(tmp_path: Path) -> None:
    from qwen_kvprep.convert import serving

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (plain / "provenance.json").write_text(json.dumps({"source": {"spelt": "Qwen/Qwen-7B-Chat"}}))
    lines = serving.commands(plain, gptq=False, max_len=8192)
    # the server's program is where this Python's vLLM is; the dtype the one OUT is stored in
    vllm = serving.vllm_launch(shlex.quote(str(plain)))
    assert lines[0] == (serving.VLLM_AUTO, f"{vllm} --max-model-len 8192 --dtype bfloat16")
    assert lines[1][0] == serving.VLLM_FP8_UNIT
    assert lines[1][1].endswith("--kv-cache-dtype fp8 --dtype bfloat16")
    assert "unmeasured" in lines[1][0] and "unmeasured" in serving.SGLANG_UNIT
    (note,) = serving.kv_notes(plain)
    assert "scale 1.0" in note and "unmeasured on this model" in note
    assert f"qwen-kvprep convert Qwen/Qwen-7B-Chat {plain} --kv-cache fp8" in note
    int8 = dict(lines)[serving.VLLM_INT8]
    assert int8.endswith("int8_per_token_head --dtype bfloat16")
    assert "50702" in serving.VLLM_INT8 and "50749" in serving.VLLM_INT8

    cal = tmp_path / "calibrated"
    cal.mkdir()
    config = scales.with_kv_scheme({"torch_dtype": "bfloat16"})
    (cal / "config.json").write_text(json.dumps(config))
    (cal / scales.SCALES_FILE).write_bytes(b"")
    lines = serving.commands(cal, gptq=False, max_len=8192)
    vllm = serving.vllm_launch(shlex.quote(str(cal)))
    assert lines[0] == (serving.VLLM_FP8, f"{vllm} --max-model-len 8192 "
                        "--kv-cache-dtype fp8 --dtype bfloat16")
    assert lines[1] == (serving.VLLM_AUTO, f"{vllm} --max-model-len 8192 "
                        "--kv-cache-dtype bfloat16 --dtype bfloat16")
    assert dict(lines)[serving.SGLANG].endswith("--kv-cache-dtype fp8_e4m3")
    (note,) = serving.kv_notes(cal)
    assert "fp8 KV cache by default" in note and "auto" in note


@pytest.mark.parametrize("shards", [1, 2])
def test_a_killed_addition_is_finished_by_the_same_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int) -> None:
    _needs_stack()
    from qwen_kvprep.convert import calibrated

    ckpt = generate_checkpoint(tmp_path / "Tiny-Chat", shards=shards)
    out = tmp_path / "out"
    convert(ckpt, out, ConvertOptions(verify=False))
    real = calibrated.atomic_write_bytes
    written: list[str] = []

    def killed_after_config(path: Any, data: bytes, mode: Any = None) -> None:
        real(path, data, mode)
        written.append(Path(path).name)
        if Path(path).name == "config.json":
            raise KeyboardInterrupt  # before provenance.json records the new files

    monkeypatch.setattr(calibrated, "atomic_write_bytes", killed_after_config)
    with pytest.raises(KeyboardInterrupt):
        convert(ckpt, out, FP8)
    assert written == [scales.SCALES_FILE, scales.INDEX, "config.json"]
    monkeypatch.setattr(calibrated, "atomic_write_bytes", real)
    lines: list[str] = []
    done = convert(ckpt, out, FP8, log=lines.append)
    assert any(line.startswith("restored ") for line in lines)
    assert done.kv_cache is not None and not done.unchanged
    prov = {f["id"]: f for f in document(invoke(
        "doctor", str(out), "--json", "--check", "convert.provenance"))["findings"]}
    assert prov["convert.provenance"]["severity"] == "ok", prov

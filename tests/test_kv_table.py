"""The engine smoke's KV table in vLLM, on a model whose K and V run past fp8 e4m3's range
(tests/kv_fixture.py) and whose folder carries calibrated KV scales: one conversion, one
engine smoke (one vLLM child, a start per dtype and scales), several judgements of it.

Needs vLLM (CI's engine stage) on a CPU with AVX-512 or AMX: vLLM's CPU build quantizes its
KV cache nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen_kvprep.tiny import generate_checkpoint
from tests import needs
from tests.cli import document, kvprep
from tests.kv_fixture import push_kv_out_of_fp8_range

pytestmark = pytest.mark.slow

def _cpu_quantizes_kv() -> None:
    flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").split()
    if "avx512f" not in flags and "amx_tile" not in flags:
        needs.skip("cpu-fp8", "this CPU has neither AVX-512 nor AMX: vLLM's CPU build "
                   "refuses every quantized KV cache here (the CPU reference, "
                   "tests/test_convert_kvcache.py, measures calibration on any CPU)")


def scales_in(out: Path) -> dict[str, float]:
    """The KV scale tensors OUT holds, read from its files."""
    from safetensors import safe_open

    found: dict[str, float] = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                    found[name] = float(f.get_tensor(name))
    assert found, f"{out} holds no KV scales"
    return found


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path,
                                                                      dict[str, float]]]:
    needs.vllm()
    _cpu_quantizes_kv()
    root = tmp_path_factory.mktemp("kvtable")
    src = generate_checkpoint(root / "src", layers=2, heads=2, head_dim=64, intermediate=128,
                              dtype="bf16", shards=1, config_overrides={"seq_length": 1024})
    push_kv_out_of_fp8_range(src)
    out = root / "out"
    made = kvprep("convert", str(src), str(out), "--no-verify", "--kv-cache", "fp8",
                  timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    scales = scales_in(out)
    res = kvprep("smoke", str(out), "--engine", "vllm", "--json", "--max-new-tokens", "4",
                 timeout=900)
    yield document(res), out, scales


def _rows(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["dtype"], r["scales"]): r for r in doc["kv_cache"]}


def test_fp8_at_scale_one_is_broken_and_with_the_folders_scales_usable(
    table: tuple[dict[str, Any], Path, dict[str, float]],
) -> None:
    doc, _out, _scales = table
    rows = _rows(doc)
    unit, calibrated = rows[("fp8_e4m3", "1.0")], rows[("fp8_e4m3", "checkpoint")]
    assert unit["accepted"] and not unit["usable"], unit
    assert calibrated["usable"], calibrated
    assert calibrated["kl_mean"] * 10 <= unit["kl_mean"]
    for row in (unit, calibrated):
        assert row["tokens_scored"] >= 400 and row["chunk"] <= 64
        assert set(row) >= {"kl_mean", "kl_p99", "top1_agree", "tokens_scored", "scales",
                            "engine_k_scale", "engine_v_scale"}
    reference = rows[("auto", "1.0")]
    assert reference["kl_mean"] == 0.0 and reference["top1_agree"] == 1.0
    # served as it is, the folder's cache is fp8 with its scales
    assert rows[("auto", "checkpoint")]["resolved"].startswith("fp8")
    best = doc["kv_cache_recommended"]
    assert best["scales"] == "checkpoint" and best["dtype"].startswith("fp8")


def test_the_engine_holds_the_folders_scales(
    table: tuple[dict[str, Any], Path, dict[str, float]],
) -> None:
    doc, _out, scales = table
    rows = _rows(doc)
    layers = len(scales) // 2
    want_k = [scales[f"model.layers.{i}.self_attn.k_scale"] for i in range(layers)]
    want_v = [scales[f"model.layers.{i}.self_attn.v_scale"] for i in range(layers)]
    row = rows[("fp8_e4m3", "checkpoint")]
    assert row["engine_k_scale"] == pytest.approx(want_k, rel=1e-6)
    assert row["engine_v_scale"] == pytest.approx(want_v, rel=1e-6)
    assert rows[("fp8_e4m3", "1.0")]["engine_k_scale"] == [1.0] * layers


def test_int8_per_token_head_is_never_usable_on_a_cpu(
    table: tuple[dict[str, Any], Path, dict[str, float]],
) -> None:
    doc, _out, _scales = table
    (row,) = [r for r in doc["kv_cache"] if r["dtype"] == "int8_per_token_head"]
    assert not row["usable"] and row["declared"] is False, row
    assert not [f for f in doc["findings"] if f["severity"] == "fail"], doc["findings"]

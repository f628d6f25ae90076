"""`convert DIR OUT --kv-cache fp8`: calibrated fp8 KV scales added to a converted OUT.

The weights are the plain conversion's, bit for bit: convert first makes (or finds) OUT as
without the option, proof and all; then, in place, under OUT's lock:

1. K (after rotary) and V are measured per layer on the calibration text, block by block
   over OUT (kvcal.calibrate); scale = absmax / 448;
2. written, each file atomically, in this order: the scales' own shard, the index (made
   where OUT had one shard), config.json's quantization_config, provenance.json (its
   records of those files, and `kv_cache`: the text's sha256 and token count, the absmax
   and scales). A folder converted without scales gets them by the same command, without
   converting again; the same command on a calibrated OUT is a no-op when the text is the
   same, and replaces the scales when it is not.

Everything is checked before the first write: the calibration text (read and tokenized
with DIR's own vocabulary before the conversion starts), OUT's record, its config.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Callable, Optional

from qwen_kvprep.common import sha256_file
from qwen_kvprep.convert import output
from qwen_kvprep.errors import KvprepError, RefusedError, UsageError
from qwen_kvprep.fsutil import atomic_write_bytes, atomic_write_text
from qwen_kvprep.gptqconfig import QUANTIZE_CONFIG
from qwen_kvprep.jsontypes import JSON, JSONObject
from qwen_kvprep.kvcal import calibrate, fp8, scales
from qwen_kvprep.kvcal.calibrate import KVAbsmax
from qwen_kvprep.kvcal.text import Calibration, calibration, tokenizer_of
from qwen_kvprep.probe.converted import probe_converted
from qwen_kvprep.provenance import PROVENANCE, read
from qwen_kvprep.untrusted import read_record

KV_RECORD = "kv_cache"  # provenance.json's key
DTYPES = ("fp8",)  # --kv-cache's choices
_HEADER_LIMIT = 100 << 20  # a safetensors header: some MB for the largest models


@dataclass(frozen=True)
class Calibrated:
    """What --kv-cache fp8 did to OUT."""

    record: JSONObject  # provenance.json's kv_cache
    unchanged: bool

    def lines(self) -> list[str]:
        cal = self.record.get("calibration")
        c = cal if isinstance(cal, dict) else {}
        k, v = self.record.get("k_scale"), self.record.get("v_scale")
        ks = [x for x in k if isinstance(x, float)] if isinstance(k, list) else []
        vs = [x for x in v if isinstance(x, float)] if isinstance(v, list) else []
        span = (f"; k_scale {min(ks):.4g} to {max(ks):.4g}, v_scale {min(vs):.4g} to "
                f"{max(vs):.4g}" if ks and vs else "")
        verb = "kept" if self.unchanged else "wrote"
        return [
            f"{verb} calibrated fp8 KV cache scales ({scales.SCALES_FILE}, absmax / 448 per "
            f"layer) measured on {c.get('tokens')} tokens of {c.get('text')} (sha256 "
            f"{str(c.get('sha256'))[:12]}){span}"
        ]


def prepare(directory: Path, calibration_file: Optional[Path]) -> Calibration:
    """The calibration text's tokens, with DIR's own vocabulary: refused (UsageError)
    before anything is written when the file is unreadable or too short."""
    return calibration(tokenizer_of(directory), calibration_file)


def recorded(out: Path) -> Optional[JSONObject]:
    """OUT's provenance kv_cache record, None when it has none."""
    try:
        data = read_record(out / PROVENANCE, 4 << 20)
    except (OSError, ValueError):
        return None
    rec = data.get(KV_RECORD) if isinstance(data, dict) else None
    return rec if isinstance(rec, dict) else None


def _same_calibration(rec: Optional[JSONObject], cal: Calibration) -> bool:
    c = rec.get("calibration") if rec is not None else None
    return isinstance(c, dict) and c.get("sha256") == cal.sha256 and c.get(
        "tokens") == len(cal.tokens)


def _single_shard(out: Path) -> dict[str, int]:
    """Tensor name -> data bytes of OUT's model.safetensors, from its header."""
    path = out / scales.SINGLE_FILE
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > _HEADER_LIMIT:
            raise RefusedError(f"{path} has a header of {n:,} bytes: not what convert wrote")
        header = json.loads(fh.read(n))
    out_sizes: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out_sizes[name] = int(b) - int(a)
    return out_sizes


def _file_record(path: Path) -> JSONObject:
    st = path.stat()
    return {"sha256": sha256_file(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _config(out: Path) -> JSONObject:
    data = read_record(out / "config.json", 1 << 20)
    if not isinstance(data, dict):
        raise RefusedError(f"{out / 'config.json'} is not a JSON object")
    return data


def check_calibratable(config: JSONObject, out: Path) -> int:
    """OUT's layer count, where its config allows an fp8 KV scheme (RefusedError else).

    GPTQ: one quantization_config per checkpoint, and vLLM's and SGLang's GPTQ configs give
    only linear (and MoE) layers a method, never attention its KV-cache one, so k_scale and
    v_scale beside GPTQ weights are not loaded. Where a GPTQ model's scales come from, were
    they loaded: its dequantized weights' K and V, which is what the Int4 kernels compute."""
    q = config.get("quantization_config")
    if isinstance(q, dict) and not scales.declares_kv_scales(config):
        raise UsageError(
            f"--kv-cache fp8: {out} holds GPTQ weights, and the engines' GPTQ quantization "
            "config gives attention no KV-cache method, so scales written beside it would not "
            "be loaded (they would be measured on the dequantized weights' K and V)",
            fix="convert without --kv-cache, and serve it with the engine's own fp8 cache "
            "(unmeasured on this model), or convert the unquantized checkpoint with "
            "--kv-cache fp8",
        )
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise RefusedError(f"{out / 'config.json'} has no num_hidden_layers")
    return layers


def measure(out: Path, cal: Calibration, layers: int,
            say: Callable[[str], None]) -> KVAbsmax:
    say(f"calibrating the fp8 KV cache: {len(cal.tokens):,} tokens of {cal.name}, "
        "OUT block by block")
    return calibrate.measure(out, cal.rows(), layers=layers,
               on_block=lambda done, total: say(f"calibrating: block {done}/{total}"))


def record_of(cal: Calibration, absmax: KVAbsmax) -> JSONObject:
    k: list[JSON] = list(fp8.scales_of(absmax.k))
    v: list[JSON] = list(fp8.scales_of(absmax.v))
    return {
        "dtype": "fp8_e4m3",
        "scheme": "compressed-tensors kv_cache_scheme: float 8 bits, static, per tensor",
        "scales_file": scales.SCALES_FILE,
        "calibration": {"text": cal.name, "sha256": cal.sha256, "tokens": len(cal.tokens)},
        "measured": "K after rotary and V, per layer, OUT block by block in float32",
        "k_absmax": [float(x) for x in absmax.k], "v_absmax": [float(x) for x in absmax.v],
        "k_scale": k, "v_scale": v,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write(out: Path, record: JSONObject, layers: int) -> None:
    """The scales' shard, the index, config.json and provenance.json, in that order."""
    want = _as_recorded(out, record, layers)
    mode = (out / "config.json").stat().st_mode & 0o777
    for name in (scales.SCALES_FILE, scales.INDEX, "config.json"):
        body = want[name]
        assert body is not None
        atomic_write_bytes(out / name, body, mode=mode)
    data = read_record(out / PROVENANCE, 4 << 20)
    recorded_outputs = data.get("outputs") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(recorded_outputs, dict):
        raise RefusedError(f"{out / PROVENANCE} has no outputs")
    outputs: dict[str, JSON] = dict(recorded_outputs)
    for name in (scales.SCALES_FILE, scales.INDEX, "config.json"):
        outputs[name] = _file_record(out / name)
    data["outputs"] = dict(sorted(outputs.items()))
    data[KV_RECORD] = record
    atomic_write_text(out / PROVENANCE, json.dumps(data, indent=2) + "\n", mode=mode)


def _stripped_index(index: JSONObject) -> tuple[JSONObject, int]:
    """The index without the scales' names, and how many there were."""
    raw_map = index.get("weight_map")
    if not isinstance(raw_map, dict):
        raise ValueError(f"{scales.INDEX} has no weight_map")
    kept = {k: v for k, v in raw_map.items() if v != scales.SCALES_FILE}
    dropped = len(raw_map) - len(kept)
    raw_meta = index.get("metadata")
    meta = dict(raw_meta) if isinstance(raw_meta, dict) else {}
    total = meta.get("total_size")
    if isinstance(total, int) and not isinstance(total, bool):
        meta["total_size"] = total - 4 * dropped
    return {"metadata": meta, "weight_map": kept}, dropped


def _as_recorded(out: Path, kv: object, layers: int,
                 plain_index: bool = True) -> dict[str, Optional[bytes]]:
    """The bytes config.json, the index and the scales' shard hold in the state
    provenance.json records (None: no such file), made again from what OUT holds now;
    `plain_index`: whether the record without scales has an index (one shard: none)."""
    from safetensors.torch import save

    config = scales.without_kv_scheme(_config(out))
    want: dict[str, Optional[bytes]] = {}
    want["config.json"] = scales.dumps(
        scales.with_kv_scheme(config) if kv is not None else config).encode()
    index_path = out / scales.INDEX
    index = read_record(index_path, 64 << 20) if index_path.is_file() else None
    plain = _stripped_index(index)[0] if isinstance(index, dict) else None
    if isinstance(kv, dict):
        k, v = kv.get("k_scale"), kv.get("v_scale")
        if not isinstance(k, list) or not isinstance(v, list) or len(k) != layers:
            raise ValueError("the record's kv_cache has no scales")
        want[scales.SCALES_FILE] = save(scales.scales_tensors(  # type: ignore[arg-type]
            [float(x) for x in k if isinstance(x, (int, float))],
            [float(x) for x in v if isinstance(x, (int, float))]), metadata={"format": "pt"})
        single = None if plain is not None else _single_shard(out)
        want[scales.INDEX] = scales.dumps(
            scales.index_with_scales(plain, single, layers, 8 * layers)).encode()
    else:
        want[scales.SCALES_FILE] = None
        want[scales.INDEX] = scales.dumps(plain).encode() if (
            plain is not None and plain_index) else None
    return want


def restore(out: Path) -> list[str]:
    """Put OUT's config.json, index and scales' shard back as provenance.json records them,
    where a killed `--kv-cache` left them between two states and nothing else differs: the
    names restored ([] when there was nothing to do, or it cannot be done exactly)."""
    if not os.path.isdir(out) or os.path.islink(out) or probe_converted(out) is None:
        return []
    with _locked(out) as lock_name:
        cv = probe_converted(out)
        if cv is None or cv.provenance is None:
            return []
        touched = {"config.json", scales.INDEX, scales.SCALES_FILE}
        off = {s.name for s in cv.outputs if s.state != "same"} | (
            set(cv.unrecorded) - {lock_name})
        if not off or not off <= touched:
            return []
        rec = cv.provenance
        try:
            layers = check_calibratable(scales.without_kv_scheme(_config(out)), out)
            want = _as_recorded(out, rec.extra.get(KV_RECORD), layers,
                                plain_index=scales.INDEX in rec.outputs)
        except (OSError, ValueError, KvprepError):
            return []
        for name, data in want.items():
            was = rec.outputs.get(name)
            if (data is None) != (was is None):
                return []
            if data is not None and was is not None and sha256(data).hexdigest() != was.sha256:
                return []
        mode = (out / "config.json").stat().st_mode & 0o777
        for name in sorted(off):
            data = want.get(name)
            if data is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(out / name)
            else:
                atomic_write_bytes(out / name, data, mode=mode)
        return sorted(off)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[str]:
    """OUT's convert lock (inside OUT) for the block; its file's name. The file goes while
    the lock is held, as convert's own staging removes it."""
    place = output.place_of(out)
    lock = output.take_lock(place)
    try:
        yield place.lock.name
    finally:
        with contextlib.suppress(OSError):
            os.unlink(place.lock)
        lock.release()


def add_scales(out: Path, cal: Calibration, say: Callable[[str], None]) -> Calibrated:
    """Calibrate OUT (a folder convert completed, checked by the caller) in place."""
    read(out)  # a sound record, or StateError
    config = _config(out)
    layers = check_calibratable(config, out)
    rec = recorded(out)
    if _same_calibration(rec, cal) and scales.declares_kv_scales(config):
        assert rec is not None
        return Calibrated(rec, unchanged=True)
    with _locked(out):
        absmax = measure(out, cal, layers, say)
        record = record_of(cal, absmax)
        write(out, record, layers)
    return Calibrated(record, unchanged=False)


__all__ = ["DTYPES", "KV_RECORD", "Calibrated", "add_scales", "prepare", "recorded"]


def refuse_gptq(directory: Path) -> None:
    """--kv-cache on a GPTQ DIR: refused before anything is read at length (module doc of
    check_calibratable says why)."""
    try:
        config = read_record(directory / "config.json", 1 << 20)
    except (OSError, ValueError):
        return  # convert's own validation says what is wrong with it
    if (directory / QUANTIZE_CONFIG).is_file() or (
            isinstance(config, dict) and isinstance(config.get("quantization_config"), dict)):
        check_calibratable({"quantization_config": {"quant_method": "gptq"}}, directory)

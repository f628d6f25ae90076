"""`convert --kv-cache fp8`'s scales against llm-compressor's, for the same model and text.

    python bench/kv_scales_llmcompressor.py --llmcompressor-python PY [--work W] [--json OUT]

Runs with qwen-kvprep's own environment; PY is an interpreter of another one that has
llm-compressor (`pip install llmcompressor`: it needs torch 2.10 or later and pulls in
datasets and accelerate, too heavy for CI), which runs this file's `--theirs` step. A tiny
checkpoint (qwen_kvprep.tiny, 2 layers, bf16) has its K and V
pushed past fp8's range (tests/kv_fixture.py: k, v x 2^12, q and c_proj / 2^12), then:

- `convert DIR OUT --kv-cache fp8 --no-verify` writes qwen-kvprep's scales (OUT block by
  block, float32, on the built-in calibration text);
- llm-compressor's `oneshot` with a KV-cache-only recipe (fp8, static, per tensor,
  symmetric, the scheme convert writes) runs the plain conversion of the same DIR, loaded
  whole in float32, on the same token rows (one sample a row), and saves it;

and the two folders' `model.layers.N.self_attn.{k,v}_scale` are compared per layer with
what each rule predicts from the same per-row maxima (each row's largest |K| and |V| per
layer, measured by qwen-kvprep's block-by-block pass on that row alone):

- qwen-kvprep: the largest of the rows' maxima / 448;
- llm-compressor (0.14, observer unset in its kv_cache_scheme): a moving average of them,
  m <- m + 0.01 (a - m) from the first row's, in the order the rows pass (here unshuffled,
  `shuffle_calibration_samples=False`; shuffled, its scales change from run to run) / 448.

TOLERANCE: float32's rounding (relative). Prints a Markdown table and a JSON summary;
exits 1 where a scale is off its prediction.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOLERANCE = 1e-5  # relative
AVERAGING = 0.01  # llm-compressor's moving-average constant, as measured here


def _scales(out: Path) -> dict[str, float]:
    from safetensors import safe_open

    found: dict[str, float] = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is no mapping)
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                    found[name] = float(fh.get_tensor(name).float().reshape(-1)[0])
    return found


def _llmcompressor(plain: Path, rows: list[list[int]], dest: Path) -> dict[str, object]:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32)
    recipe = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      kv_cache_scheme:
        num_bits: 8
        type: float
        strategy: tensor
        dynamic: false
        symmetric: true
"""
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=max(map(len, rows)),
            num_calibration_samples=len(rows), output_dir=str(dest),
            shuffle_calibration_samples=False)
    config = json.loads((dest / "config.json").read_text())
    q = config.get("quantization_config", {})
    return dict(q)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--llmcompressor-python", default=None)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--theirs", nargs=3, metavar=("PLAIN", "ROWS", "DEST"), default=None,
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.theirs is not None:  # in llm-compressor's environment
        plain, rows_json, dest = args.theirs
        written = _llmcompressor(Path(plain), json.loads(Path(rows_json).read_text()),
                                 Path(dest))
        versions = {d: importlib.metadata.version(d) for d in (
            "llmcompressor", "compressed-tensors", "torch", "transformers")}
        from safetensors import safe_open

        shapes = {}
        for path in sorted(Path(dest).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118
                    if name.endswith("_scale"):
                        t = fh.get_tensor(name)
                        shapes[name] = f"{str(t.dtype)[6:]} {list(t.shape)} in {path.name}"
        (Path(dest) / "bench.json").write_text(json.dumps(
            {"config": written, "scale_tensors": shapes, **versions}))
        return 0
    if args.llmcompressor_python is None:
        p.error("--llmcompressor-python is required")

    from qwen_kvprep.convert.run import ConvertOptions, convert
    from qwen_kvprep.kvcal import text
    from qwen_kvprep.tiny import generate_checkpoint
    from tests.kv_fixture import push_kv_out_of_fp8_range

    work = Path(tempfile.mkdtemp(prefix="kvscales-", dir=args.work))
    try:
        ckpt = generate_checkpoint(work / "Tiny-Chat", shards=2)
        push_kv_out_of_fp8_range(ckpt)
        ours = convert(ckpt, work / "ours", ConvertOptions(verify=False, kv_cache="fp8")).out
        plain = convert(ckpt, work / "plain", ConvertOptions(verify=False)).out
        cal = text.default_calibration(text.tokenizer_of(plain))
        theirs_dir = work / "llmcompressor"
        rows_json = work / "rows.json"
        rows_json.write_text(json.dumps(cal.rows()))
        subprocess.run([args.llmcompressor_python, __file__, "--theirs", str(plain),
                        str(rows_json), str(theirs_dir)], check=True)
        info = json.loads((theirs_dir / "bench.json").read_text())
        a, b = _scales(ours), _scales(theirs_dir)
        from qwen_kvprep.kvcal.calibrate import measure

        per_row = [measure(plain, [r], layers=2) for r in cal.rows()]
        rows = []
        within = True
        for name in sorted(a):
            layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[1][0]
            maxima = [getattr(m, kind)[layer] for m in per_row]
            avg = maxima[0]
            for x in maxima[1:]:
                avg += AVERAGING * (x - avg)
            want_ours, want_theirs = max(maxima) / 448, avg / 448
            got = b.get(name, float("nan"))
            off = max(abs(a[name] - want_ours) / want_ours, abs(got - want_theirs) / want_theirs)
            within = within and off <= TOLERANCE
            rows.append({"tensor": name, "row_maxima": maxima, "qwen_kvprep": a[name],
                         "predicted_max": want_ours, "llmcompressor": got,
                         "predicted_average": want_theirs, "off": off})
        doc = {
            **{k: v for k, v in info.items() if k != "config"},
            "calibration_tokens": len(cal.tokens), "rows": rows, "within": within,
            "tolerance": TOLERANCE,
            "their_config": info["config"],
            "names_only_theirs": sorted(set(b) - set(a)),
        }
        print("| tensor | rows' absmax | qwen-kvprep (max/448) | llm-compressor | its "
              "prediction (average/448) | worst relative miss |")
        print("|---|---|---:|---:|---:|---:|")
        for r in rows:
            maxima = ", ".join(f"{x:.6g}" for x in r["row_maxima"])
            print(f"| {r['tensor']} | {maxima} | {r['qwen_kvprep']:.8g} | "
                  f"{r['llmcompressor']:.8g} | {r['predicted_average']:.8g} | {r['off']:.1e} |")
        print(json.dumps({k: v for k, v in doc.items() if k != "rows"}, indent=2))
        if args.json is not None:
            args.json.write_text(json.dumps(doc, indent=2))
        return 0 if doc["within"] else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())

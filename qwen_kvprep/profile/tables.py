"""The text output of `profile`: the rows as a table, one summary line, the quality block."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from qwen_kvprep.profile.evaluate import human_bytes

if TYPE_CHECKING:
    from qwen_kvprep.profile.document import ProfileDocument
    from qwen_kvprep.profile.protocol import QualityResult
    from qwen_kvprep.profile.runner import ProfileRow

_COLUMNS = (
    ("mode", "<"),
    ("batch", ">"),
    ("cached", ">"),
    ("KV bytes", ">"),
    ("peak", ">"),
    ("predicted", ">"),
    ("decode tok/s", ">"),
    ("kernel layers", ">"),
    ("OOM", "<"),
)


def _rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _cells(row: ProfileRow, layers: Optional[int]) -> list[str]:
    kernel = "-" if row["kernel_layers"] is None or row["oom"] else str(row["kernel_layers"])
    if row["mode"] == "int8" and kernel != "-" and layers:
        kernel = f"{row['kernel_layers']}/{layers}"
        if row.get("fast_layers") == layers:
            kernel += " fast"
    if row["oom"]:
        oom = "OOM" + (" (skipped)" if str(row.get("error") or "").startswith("skipped") else "")
    elif row["error"]:
        oom = "failed" if not str(row["error"]).startswith("skipped") else "skipped"
    else:
        oom = "no"
    return [
        row["mode"],
        str(row["batch"]),
        "-" if row["cached_tokens"] is None else str(row["cached_tokens"]),
        "-" if row["kv_bytes"] is None else f"{row['kv_bytes']:,}",
        human_bytes(row["peak_bytes"]),
        human_bytes(row["predicted_bytes"]),
        _rate(row["decode_tokens_per_s"]),
        kernel,
        oom,
    ]


# The peak and predicted columns where the two are not the same measure (profile on a CPU):
# each named by what it is, and a note under the table saying so.
_RSS_HEADS = {"peak": "peak RSS", "predicted": "plan (GPU)"}
RSS_NOTE = (
    "peak RSS: the process's peak resident memory on this CPU (the interpreter, torch and\n"
    "the weights included); plan (GPU): plan's prediction of the CUDA allocator's peak on a\n"
    "GPU. Different measures: the two columns do not compare."
)


def table(rows: list[ProfileRow], layers: Optional[int],
          measure: str = "cuda_allocator") -> str:
    """The rows as a table; `measure` is the document's peak_measure: unless the measured
    peak is the CUDA allocator's (what plan predicts), the two columns say what each is."""
    body = [_cells(r, layers) for r in rows]
    heads = [c for c, _ in _COLUMNS]
    if measure != "cuda_allocator":
        heads = [_RSS_HEADS.get(h, h) for h in heads]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(heads)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            f"{c:{a}{w}}" for c, (_, a), w in zip(cells, _COLUMNS, widths)
        ).rstrip()

    return "\n".join([line(heads), *(line(b) for b in body)])


def summary(profile: ProfileDocument) -> str:
    """Largest batch that fit per mode (a "+" where the mode never ran out of memory, so
    its limit lies beyond) with the gain, and the decode speed of int8 against unquantized
    at batch 1."""
    rows = profile["rows"]
    fit = profile["max_batch"]
    parts = []
    if all(fit.get(m) is None for m in ("unquantized", "int8")):
        parts.append("no batch ran to the end in either mode")
    else:
        hit = {m: any(r["oom"] for r in rows if r["mode"] == m) for m in ("unquantized", "int8")}
        shown = {m: "none" if fit.get(m) is None else f"{fit[m]}{'' if hit[m] else '+'}"
                 for m in ("unquantized", "int8")}
        text = f"largest batch that fit: unquantized {shown['unquantized']}, int8 {shown['int8']}"
        u, q = fit.get("unquantized"), fit.get("int8")
        if u and q and (hit["unquantized"] or hit["int8"]):
            at_least = "at least " if not hit["int8"] else ""
            text += f" ({at_least}{q / u:.2g}x with the Int8 cache)"
        elif not hit["unquantized"] and not hit["int8"]:
            text += " (neither ran out of memory: try larger --batch values to find the limits)"
        parts.append(text)
    speeds = {r["mode"]: r["decode_tokens_per_s"] for r in rows
              if r["batch"] == 1 and r["decode_tokens_per_s"]}
    if "unquantized" in speeds and "int8" in speeds:
        parts.append(
            f"decode at batch 1: int8 {speeds['int8']:,.1f} tok/s vs unquantized "
            f"{speeds['unquantized']:,.1f} ({speeds['int8'] / speeds['unquantized']:.2f}x)"
        )
    return "summary: " + "; ".join(parts)


def quality_block(q: Optional[QualityResult]) -> Optional[str]:
    if not q:
        return None

    def ppl(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.4g}"

    return "\n".join([
        f"quality: teacher-forced over {q['tokens']} tokens ({q['text']}; the first "
        f"{q['prefill_tokens']} as one prompt chunk, the rest one by one through the cache)",
        f"  top-1 agreement      {100 * q['top1_agreement']:.2f}%",
        f"  perplexity           {ppl(q['ppl_unquantized'])} unquantized, "
        f"{ppl(q['ppl_int8'])} int8",
        f"  |logit difference|   mean {q['mean_abs_logit_diff']:.3g}, "
        f"max {q['max_abs_logit_diff']:.3g}",
    ])


def _weights(profile: ProfileDocument) -> str:
    model = profile["model"]
    weights, bits = model.get("weights_bytes"), model.get("gptq_bits")
    if weights is None:
        return ""
    return f"; weights {human_bytes(weights)}" + (f" (GPTQ Int{bits})" if bits else "")


def render_text(profile: ProfileDocument) -> str:
    d = profile["device"]
    head = (
        f"profile of {profile['directory']}"
        + (" (random weights)" if profile["random_weights"] else "")
        + f" on {d.get('kind')} ({d.get('name')}), {profile['dtype']}, prompt "
        f"{profile['prompt_tokens']} + {profile['new_tokens']} new tokens"
        + (f", prefill chunks of {profile['prefill_chunk']}" if profile["prefill_chunk"] else "")
        + _weights(profile)
    )
    measure = profile.get("peak_measure", "cuda_allocator")
    out = [head, "", table(profile["rows"], profile["model"]["layers"], measure)]
    if measure != "cuda_allocator":
        out.append(RSS_NOTE)
    out += ["", summary(profile)]
    quality = quality_block(profile.get("quality"))
    if quality:
        out += ["", quality]
    return "\n".join(out)

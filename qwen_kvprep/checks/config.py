"""Checks of config.json: parse, model type, the KV-cache flags and the flash-attn conflict.

Judged on the config alone. Where the outcome also depends on the environment (whether
flash_attn is installed, the GPU), the message says so; the env checks judge that part.
Absent keys take QWenConfig's defaults (Qwen's configuration_qwen.py, as in
tiny/remote/): use_cache_quantization=False, use_cache_kernel=False, use_flash_attn="auto".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Union

from qwen_kvprep.checks.checkpoint import redownload
from qwen_kvprep.checks.registry import (
    CHECKPOINT,
    CONFIG_JUDGED,
    CONFIG_PARSED,
    QWEN_V1,
    check,
    checkpoint_of,
)
from qwen_kvprep.checks.verdicts import fail, info, ok, skip, warn
from qwen_kvprep.configjson import CONFIG
from qwen_kvprep.findings import Finding
from qwen_kvprep.probe.checkpoint import CheckpointFacts
from qwen_kvprep.probe.facts import Facts

if TYPE_CHECKING:
    from qwen_kvprep.jsontypes import JSON

DEFAULTS: dict[str, JSON] = {
    "use_cache_quantization": False,
    "use_cache_kernel": False,
    "use_flash_attn": "auto",
}


def _config(facts: Facts) -> tuple[CheckpointFacts, dict[str, JSON]]:
    cp = checkpoint_of(facts)
    assert cp.config is not None, "declare needs=(CHECKPOINT, QWEN_V1, CONFIG_PARSED)"
    return cp, cp.config


def _shown(cfg: Mapping[str, JSON], key: str) -> str:
    if key not in cfg:
        return f"absent (default {json.dumps(DEFAULTS[key])})"
    return json.dumps(cfg[key])


@check(
    "config.parse",
    "config.json parses and describes a Qwen (v1) model",
    needs=(CHECKPOINT, CONFIG_JUDGED),
)
def parse(facts: Facts) -> Union[Finding, list[Finding]]:
    cp = checkpoint_of(facts)
    path = cp.path / CONFIG
    if CONFIG not in cp.files:
        return skip(f"{CONFIG} is missing (see checkpoint.files)")
    if cp.problem(CONFIG) is not None:
        return skip(f"{CONFIG} is not a config file at all (see checkpoint.content)")
    if cp.config is None:
        where = f"repair line {cp.config_error_line} of {path}, or re-download it: " if (
            cp.config_error_line
        ) else "re-download it: "
        error = cp.config_error or f"{path} cannot be read"
        # what transformers does is claimed only where it was checked (CheckpointFacts.
        # config_error_kind); otherwise only what qwen-kvprep refuses, and why
        kind = getattr(cp, "config_error_kind", None)
        ours = (
            ": qwen-kvprep refuses it as a model config (a Qwen config.json is a few KiB of "
            "plain JSON with unique keys), and fix changes nothing"
        )
        if kind == "json":
            consequence = (
                f", so loading fails with `OSError: It looks like the config file at '{path}' "
                "is not a valid JSON file.`"
            )
        elif kind == "digits":
            consequence = ours + "; transformers itself stops at it with the same ValueError"
        elif kind == "size":
            consequence = ours + " (transformers itself would read it whole and load it)"
        else:
            consequence = ours
        return fail(
            error + consequence,
            where + redownload(cp, [CONFIG]), paths=[path], line=cp.config_error_line,
        )
    cfg = cp.config
    # model_type is "qwen" here (the QWEN_V1 need; checkpoint.identity judges the rest)
    auto_map = cfg.get("auto_map")
    if not isinstance(auto_map, dict) or "AutoModelForCausalLM" not in auto_map:
        return warn(
            f"{CONFIG} has no auto_map.AutoModelForCausalLM, so AutoModelForCausalLM cannot find "
            "the remote code (`ValueError: Unrecognized configuration class`)",
            redownload(cp, [CONFIG]), paths=[path],
        )
    return ok(f"{CONFIG} parses: a Qwen (v1) config with remote code in auto_map")


@check(
    "config.kv_cache",
    "The Int8 KV cache and its kernel are switched on",
    needs=(CHECKPOINT, QWEN_V1, CONFIG_PARSED),
)
def kv_cache(facts: Facts) -> Finding:
    cp, cfg = _config(facts)
    path = cp.path / CONFIG
    quant = bool(cfg.get("use_cache_quantization", DEFAULTS["use_cache_quantization"]))
    kernel = bool(cfg.get("use_cache_kernel", DEFAULTS["use_cache_kernel"]))
    flags = {k: cfg.get(k, DEFAULTS[k]) for k in ("use_cache_quantization", "use_cache_kernel")}
    # A server started now must run the Int8 cache through the kernel whenever the config
    # asks for either: one without the other is a silent fallback (doctor exits 1). Both off
    # is a plain choice: a warning.
    if not quant and kernel:
        return fail(
            "use_cache_kernel is on but use_cache_quantization is "
            f"{_shown(cfg, 'use_cache_quantization')}, so the kernel does nothing and the KV "
            "cache stays full size",
            cp.fix_command, paths=[path], details=flags,
        )
    if not quant:
        return warn(
            f"Int8 KV cache is off (use_cache_quantization is "
            f"{_shown(cfg, 'use_cache_quantization')}), so the KV cache takes about twice the "
            "memory it needs",
            cp.fix_command, paths=[path], details=flags,
        )
    if not kernel:
        return fail(
            f"Int8 KV cache is on but use_cache_kernel is {_shown(cfg, 'use_cache_kernel')}, so "
            "every step dequantizes the whole cache in pure torch (the slow fallback)",
            cp.fix_command, paths=[path], details=flags,
        )
    return ok("Int8 KV cache and its kernel are on (use_cache_quantization, use_cache_kernel)")


def flash_attn_off(cfg: Mapping[str, JSON]) -> bool:
    """Whether the config switches flash-attn off for certain.

    The remote code turns "auto" on whenever flash_attn imports and half precision is in
    effect; only a falsy value other than "auto" keeps it off everywhere.
    """
    value = cfg.get("use_flash_attn", DEFAULTS["use_flash_attn"])
    return value != "auto" and not value


@check(
    "config.flash_attn",
    "flash-attn is off where the Int8 KV cache is on",
    needs=(CHECKPOINT, QWEN_V1, CONFIG_PARSED),
)
def flash_attn(facts: Facts) -> Finding:
    cp, cfg = _config(facts)
    path = cp.path / CONFIG
    shown = _shown(cfg, "use_flash_attn")
    if flash_attn_off(cfg):
        return ok(f"use_flash_attn is {shown}")
    if cfg.get("use_cache_quantization", DEFAULTS["use_cache_quantization"]):
        return fail(
            f"use_flash_attn is {shown} while the Int8 KV cache is on, and the remote code does "
            "not switch flash-attn off: wherever flash_attn is installed and the model runs in "
            "bf16/fp16 on a GPU, generation fails with `AttributeError: 'tuple' object has no "
            "attribute 'dtype'`",
            f"{cp.fix_command}  (sets use_flash_attn to false)", paths=[path],
            use_flash_attn=cfg.get("use_flash_attn", DEFAULTS["use_flash_attn"]),
        )
    return info(
        f"use_flash_attn is {shown}: harmless while the Int8 KV cache is off, but it must be "
        "false once the cache is on (fix sets both)",
        cp.fix_command, paths=[path],
    )


@check(
    "config.symlink",
    "config.json can be patched without touching a shared blob",
    needs=(CHECKPOINT, QWEN_V1),
)
def symlink(facts: Facts) -> Finding:
    cp = checkpoint_of(facts)
    path = cp.path / CONFIG
    if not cp.config_is_symlink:
        if CONFIG not in cp.files:
            return skip(f"{CONFIG} is missing (see checkpoint.files)")
        return ok(f"{CONFIG} is a regular file")
    return info(
        f"{CONFIG} is a symlink (to {cp.config_link_target}), as in a huggingface_hub cache: fix "
        "will replace the link with a patched file and never write the blob it points to",
        paths=[path], target=cp.config_link_target,
    )

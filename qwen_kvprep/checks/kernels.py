"""Checks on the kernel sources: which ones the checkpoint (and the modules-cache copy of
its code) holds, and whether Qwen's own sources can compile with this torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Optional

from qwen_kvprep import catalogue
from qwen_kvprep.checks.registry import ENV, GIVEN_CHECKPOINT, QWEN_V1, check, checkpoint_of
from qwen_kvprep.checks.verdicts import fail, info, ok, skip, warn
from qwen_kvprep.common import KERNEL_FILES
from qwen_kvprep.findings import Finding, FindingsLike
from qwen_kvprep.probe.facts import Facts

if TYPE_CHECKING:
    from qwen_kvprep.probe.caches import ModuleFolder
    from qwen_kvprep.probe.env import EnvFacts

_LABEL = {
    catalogue.OFFICIAL: "official",
    catalogue.OURS: "qwen-kvprep's",
    catalogue.MODIFIED: "modified/unknown",
    catalogue.MISSING: "missing",
}


def _listing(per_file: Mapping[str, str], hashes: Mapping[str, Optional[str]]) -> str:
    parts = []
    for name, kind in per_file.items():
        sha = hashes.get(name)
        extra = f", sha256 {sha[:16]}…" if kind == catalogue.MODIFIED and sha else ""
        parts.append(f"{name}: {_LABEL[kind]}{extra}")
    return "; ".join(parts)


def kernel_requested(facts: Facts) -> bool:
    """Whether the checkpoint's config asks for the Int8 cache through the kernel: then a
    server started now must find the kernel, or it silently falls back (doctor exits 1)."""
    cfg = getattr(facts.checkpoint, "config", None)
    if not isinstance(cfg, dict):
        return False
    return cfg.get("use_cache_quantization") is True and cfg.get("use_cache_kernel") is True


def _judge(
    where: str,
    hashes: Mapping[str, Optional[str]],
    ours: Optional[Mapping[str, str]],
    fix_cmd: str,
    requested: bool = False,
) -> Finding:
    """The finding for one place's kernel sources; a missing or unknown pair fails where
    the config asks for the kernel (a server started now would silently fall back)."""
    bad = fail if requested else warn
    asked = (
        "; config.json turns the Int8 cache and its kernel on, so a server started now "
        "silently runs without the kernel" if requested else ""
    )
    kind, per_file = catalogue.classify_set(hashes, ours)
    details: dict[str, object] = {"where": where, "kind": kind, "files": dict(per_file)}
    if kind == catalogue.OFFICIAL:
        return ok(f"{where}: Qwen's official kernel sources", details=details)
    if kind == catalogue.OURS:
        return ok(f"{where}: qwen-kvprep's kernel sources", details=details)
    if kind == catalogue.MISSING:
        # The model then warns once and silently runs the slower pure-torch path.
        return bad(
            f"{where}: no kernel sources (the model falls back to the slow path){asked}",
            fix_cmd,
            details=details,
        )
    problem = (
        "the two files come from different sets (the .cpp binds the functions its own .cu defines)"
        if kind == catalogue.MIXED and catalogue.MODIFIED not in per_file.values()
        else "not a known pair"
    )
    note = "" if ours is not None else " (qwen-kvprep's own kernels/ were not found to compare)"
    return bad(
        f"{where}: {problem}: {_listing(per_file, hashes)}{note}{asked}",
        fix_cmd,
        details=details,
    )


@check(
    "kernels.sources",
    "Which kernel sources the checkpoint holds",
    needs=(GIVEN_CHECKPOINT, QWEN_V1),
)
def kernel_sources(facts: Facts) -> FindingsLike:
    cp = checkpoint_of(facts)
    ours = catalogue.ours_hashes()
    fix_cmd = cp.fix_command
    requested = kernel_requested(facts)
    out = [
        _judge("checkpoint", getattr(cp, "kernel_sources", None) or {}, ours, fix_cmd, requested)
    ]
    # The model looks for the sources next to the modules-cache copy of its code (modcache.py
    # says why): that copy matters as much as the checkpoint's own. A folder that does not
    # exist yet is created by transformers (or fix) later, so there is nothing to judge.
    for folder in _module_folders(facts):
        if not any(folder.files.get(n) for n in KERNEL_FILES) and getattr(
            cp, "serves_any_modules_cache", False
        ):
            out.append(
                ok(
                    f"modules cache {folder.path}: no kernel sources, and none needed there "
                    "(the checkpoint's compatibility module gives the layers the extension "
                    "without them)",
                    details={"where": f"modules cache {folder.path}", "kind": catalogue.MISSING},
                )
            )
            continue
        out.append(
            _judge(f"modules cache {folder.path}", folder.files, ours, fix_cmd, requested)
        )
    return out


def _module_folders(facts: Facts) -> list[ModuleFolder]:
    folders = getattr(facts.caches, "module_folders", None) or ()
    return [f for f in folders if getattr(f, "exists", False)]


def _env_torch(env: Optional[EnvFacts]) -> tuple[Optional[str], Optional[str]]:
    """(torch version, torch.version.cuda) from EnvFacts (probe/env.py): torch_cuda is
    None for a CPU-only build."""
    version = getattr(env, "torch_version", None)
    cuda = getattr(env, "torch_cuda", None)
    return (version if isinstance(version, str) else None), cuda


@check(
    "kernels.official_compat",
    "Whether Qwen's own kernel sources compile with this torch",
    needs=(ENV.saying("environment not probed"),),
)
def official_compat(facts: Facts) -> FindingsLike:
    version, cuda = _env_torch(facts.env)
    compat = catalogue.official_compat(version, cuda)
    if compat.status == "unknown":
        return skip(f"cannot tell: {compat.reason}")
    cp = facts.checkpoint
    held = [getattr(cp, "kernel_sources", None) or {}] if cp is not None else []
    held += [folder.files for folder in _module_folders(facts)]
    holds_official = any(
        catalogue.OFFICIAL in catalogue.classify_set(h, None)[1].values() for h in held
    )
    details = {"torch": version, "torch_cuda": cuda, "status": compat.status}
    if holds_official and cp is not None:
        if compat.status == "no":
            return fail(
                f"the official kernel sources here cannot compile: {compat.reason}",
                f"{cp.fix_command} --source vendored",
                details=details,
            )
        return ok(f"official sources: {compat.reason}", details=details)
    if compat.status == "no":
        return info(
            f"Qwen's official sources would not compile here: {compat.reason}; "
            "qwen-kvprep's own kernels are used by default",
            details=details,
        )
    return info(f"official sources: {compat.reason}", details=details)

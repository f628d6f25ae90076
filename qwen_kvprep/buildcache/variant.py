"""Prebuilt variants: a published build laid out for other machines, read back and verified,
and installed into the build cache as if it had been compiled there.

    <SOURCE>/build/<variant>/metadata.json           what the variant is and holds
    <SOURCE>/build/<variant>/cache_autogptq_cuda_256.so
    <SOURCE>/build/<variant>/<kernel sources>         the sources it was built from

The variant's name (`torch2.5.1-cxx11-cu124-sm80_sm90-cp311-x86_64-linux`) is for people;
its build key, recomputed here from the inputs the metadata records, decides what it fits.
Everything in a variant folder is untrusted: the metadata is read bounded and checked
against its types, every file against its sha256, before anything is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, TypedDict

from qwen_kvprep import catalogue
from qwen_kvprep.buildcache.builder import _publish, build_key, find_build
from qwen_kvprep.buildcache.lock import build_lock, lock_timeout
from qwen_kvprep.buildcache.manifest import (
    EXTENSION_NAME,
    MANIFEST,
    PREBUILT,
    BuildInputs,
    Manifest,
    dumps,
    parse_manifest,
)
from qwen_kvprep.common import KERNEL_FILES, sha256_bytes, sha256_file
from qwen_kvprep.errors import CacheError, SourceError
from qwen_kvprep.untrusted import RECORD_DEPTH, RECORD_LIMIT, load_json, read_regular

if TYPE_CHECKING:
    from qwen_kvprep.buildcache.builder import BuildResult, Notify
    from qwen_kvprep.buildcache.paths import CacheLayout
    from qwen_kvprep.jsontypes import JSON

BUILD_DIRNAME = "build"
METADATA = "metadata.json"
METADATA_VERSION = 1
SO_FILE = f"{EXTENSION_NAME}.so"
# A CUDA build for many architectures is tens of MiB; nothing legitimate comes near this.
FILE_LIMIT = 2 << 30
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class VariantMetadata(TypedDict):
    metadata_version: int
    variant: str  # the folder's name
    key: str  # the build key (sha256 of manifest.inputs)
    manifest: Manifest  # installed as the build cache entry's manifest.json
    sources: dict[str, str]  # kernel source file name -> sha256 (= manifest.inputs.sources)
    files: dict[str, str]  # every shipped file but metadata.json -> sha256


def variant_name(inputs: BuildInputs, with_cuda: bool, os_name: str = sys.platform) -> str:
    """The folder name a person reads the ABI from: torch version, C++ ABI, CUDA (with
    the architectures) or cpu, Python tag, machine, OS."""
    torch = inputs["torch"].split("+")[0]
    abi = "cxx11" if inputs["cxx11_abi"] else "cxx98"
    cuda = inputs["torch_cuda"]
    if cuda and with_cuda:
        archs = "_".join(
            "sm" + a.replace(".", "").replace("+PTX", "ptx").lower() for a in inputs["arch_list"]
        )
        device = f"cu{cuda.replace('.', '')}-{archs}"
    elif cuda:
        device = f"cu{cuda.replace('.', '')}-cpuonly"  # torch has CUDA, the extension not
    else:
        device = "cpu"
    # common.machine() is "linux-x86_64": shown as "x86_64-linux", the way wheels spell it
    system, _, arch = inputs["machine"].partition("-")
    if not arch:
        system, arch = ("linux" if os_name.startswith("linux") else os_name), system
    name = "-".join([f"torch{torch}", abi, device, inputs["python_tag"], arch, system])
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name + _sources_tag(inputs["sources"]))


def _sources_tag(sources: dict[str, str]) -> str:
    """"" for qwen-kvprep's own kernels, "-official" for Qwen's, "-src<sha256[:8]>" for any
    other: builds of other sources for one ABI get folders of their own, so that exporting
    one does not replace the other (`fix --prebuilt --source` picks among them)."""
    kind, _ = catalogue.classify_set(sources, catalogue.ours_hashes())
    if kind == catalogue.OURS:
        return ""
    if kind == catalogue.OFFICIAL:
        return "-official"
    return "-src" + sha256_bytes(json.dumps(sorted(sources.items())).encode())[:8]


def describe(inputs: BuildInputs, cuda: bool) -> str:
    """One line for people: what a variant (or this machine) is."""
    device = (
        f"CUDA {inputs['torch_cuda']} for {';'.join(inputs['arch_list'])}"
        if cuda
        else "CPU-only extension"
    )
    abi = "cxx11" if inputs["cxx11_abi"] else "pre-cxx11"
    return (
        f"torch {inputs['torch']}, {abi} ABI, {device}, {inputs['python_tag']}, "
        f"{inputs['machine']}, qwen-kvprep {inputs['tool_version']}"
    )


@dataclass(frozen=True)
class Variant:
    """A variant folder whose metadata is consistent (its files not yet verified)."""

    name: str
    folder: Path
    metadata: VariantMetadata
    metadata_sha256: str

    @property
    def key(self) -> str:
        return self.metadata["key"]

    @property
    def manifest(self) -> Manifest:
        return self.metadata["manifest"]

    @property
    def inputs(self) -> BuildInputs:
        return self.metadata["manifest"]["inputs"]


class VariantProblem(ValueError):
    """Why a variant folder cannot be used (its metadata is missing or inconsistent)."""


def _metadata_problem(data: JSON, name: str) -> Optional[str]:
    if not isinstance(data, dict) or data.get("metadata_version") != METADATA_VERSION:
        return f"{METADATA} is not version {METADATA_VERSION} qwen-kvprep variant metadata"
    manifest = parse_manifest(data.get("manifest"))
    if manifest is None:
        return f"{METADATA} holds no usable build manifest"
    key, sources, files = data.get("key"), data.get("sources"), data.get("files")
    if data.get("variant") != name:
        return f"{METADATA} names the variant {data.get('variant')!r}, not its folder {name!r}"
    if key != manifest["key"] or key != build_key(manifest["inputs"]):
        return f"{METADATA}'s key does not match the build inputs it records"
    if manifest["so"] != SO_FILE:
        return f"the extension must be {SO_FILE}, not {manifest['so']!r}"
    expected = {SO_FILE: manifest["so_sha256"], **manifest["inputs"]["sources"]}
    if sources != manifest["inputs"]["sources"] or set(manifest["inputs"]["sources"]) - set(
        KERNEL_FILES
    ):
        return f"{METADATA}'s sources differ from those the build was made from"
    if KERNEL_FILES[0] not in sources:
        # every build compiles the .cpp; without it fix would install a library and plant
        # no kernel sources in the checkpoint
        return f"{METADATA} records no kernel sources ({KERNEL_FILES[0]})"
    if not isinstance(files, dict) or files != expected:
        return f"{METADATA}'s file list is not the extension and its kernel sources"
    if not all(isinstance(v, str) and _SHA256.match(v) for v in expected.values()):
        return f"{METADATA} holds a malformed sha256"
    return None


def read_variant(folder: Path) -> Variant:
    """The variant in `folder`; VariantProblem when it is none we can use."""
    name = folder.name
    if not NAME.match(name):
        raise VariantProblem(f"{name!r} is not a variant folder name")
    path = folder / METADATA
    try:
        raw = read_regular(path, RECORD_LIMIT)
        data: JSON = load_json(raw, RECORD_DEPTH)
    except FileNotFoundError:
        raise VariantProblem(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise VariantProblem(f"{path} cannot be read: {exc}") from None
    why = _metadata_problem(data, name)
    if why is not None:
        raise VariantProblem(why)
    metadata: VariantMetadata = data  # type: ignore[assignment]  # checked just above
    return Variant(name, folder, metadata, sha256_bytes(raw))


def list_variants(root: Path) -> tuple[list[Variant], dict[str, str]]:
    """(usable variants, {folder name: why not}) under `root/build/`."""
    good: list[Variant] = []
    bad: dict[str, str] = {}
    try:
        entries = sorted((root / BUILD_DIRNAME).iterdir())
    except OSError:
        return good, bad
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            good.append(read_variant(entry))
        except VariantProblem as exc:
            bad[entry.name] = str(exc)
    return good, bad


def _file_sha256(path: Path) -> Optional[str]:
    """sha256 of a regular file (a link into a huggingface_hub blob is followed), or None
    when it is missing, not a regular file or beyond any size we accept."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > FILE_LIMIT:
            return None
        return sha256_file(path)
    except OSError:
        return None


def bad_files(variant: Variant) -> dict[str, Optional[str]]:
    """{file: the sha256 found (None: missing or unreadable)} for every shipped file that
    differs from the metadata; empty when all match."""
    out: dict[str, Optional[str]] = {}
    for rel, digest in variant.metadata["files"].items():
        got = _file_sha256(variant.folder / rel)
        if got != digest:
            out[rel] = got
    return out


def verified_sources(variant: Variant) -> dict[str, bytes]:
    """The kernel sources' bytes, each checked against the metadata as read."""
    out: dict[str, bytes] = {}
    for name, digest in variant.metadata["sources"].items():
        data = read_regular(variant.folder / name, 64 << 20)
        if sha256_bytes(data) != digest:
            raise SourceError.failing(
                "prebuilt.verify",
                f"{variant.folder / name} changed while it was being verified "
                f"(sha256 {sha256_bytes(data)}, metadata says {digest})",
                "run the command again; if it persists, fetch the variant anew",
                [variant.folder / name],
            )
        out[name] = data
    return out


def installed_key(variant: Variant) -> str:
    """The build-cache key a prebuilt variant is installed under: its ABI key and its
    library's sha256, in a namespace of its own. A local compile's key (the ABI inputs
    alone) can never name it, so a library someone else compiled never serves a plain
    `fix`, and two variants with equal inputs but other libraries never share a folder."""
    text = f"{PREBUILT}\0{variant.key}\0{variant.manifest['so_sha256']}"
    return sha256_bytes(text.encode("utf-8"))


def install(variant: Variant, layout: CacheLayout, notify: Notify, source: str) -> BuildResult:
    """Put the variant into the build cache as `builds/<installed key>/` (its manifest and
    extension), under the key's lock, with one rename. The extension is hashed again after
    it was copied, so what is published is what was verified. An entry already there is
    kept only when it is this very library (its sha256 checked again): anything else there
    is replaced, whatever its manifest says."""
    key = installed_key(variant)
    expected = variant.manifest["so_sha256"]

    def intact() -> Optional[BuildResult]:
        found = find_build(layout, key, origin=PREBUILT)
        if found is not None and found.manifest["so_sha256"] == expected:
            return found
        return None

    found = intact()
    if found is not None:
        return found
    layout.ensure_writable()
    with build_lock(layout, key, lock_timeout(), notify):
        found = intact()
        if found is not None:
            return found
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.{os.getpid()}.", dir=layout.tmp))
        try:
            out = staging / "out"
            out.mkdir()
            shutil.copyfile(variant.folder / SO_FILE, out / SO_FILE)
            got = sha256_file(out / SO_FILE)
            if got != expected:
                raise SourceError.failing(
                    "prebuilt.verify",
                    f"{variant.folder / SO_FILE} changed while it was being installed "
                    f"(sha256 {got}); nothing was installed",
                    "run the command again; if it persists, fetch the variant anew",
                    [variant.folder / SO_FILE],
                    file=SO_FILE,
                    sha256=got,
                )
            manifest: Manifest = {**variant.manifest, "key": key, "origin": PREBUILT,
                                  "source": source, "abi_key": variant.key}
            (out / MANIFEST).write_text(dumps(manifest), encoding="utf-8")
            _publish(out, layout, key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    found = intact()
    if found is None:
        message = f"the installed build {layout.build_dir(key)} does not verify"
        raise CacheError.failing("prebuilt.install", message, paths=[layout.build_dir(key)])
    return found


@dataclass(frozen=True)
class Chosen:
    """The variant `fix --prebuilt` chose for this machine, its files verified."""

    variant: Variant
    sources: dict[str, bytes]  # the kernel sources it was built from (verified bytes)
    where: str  # where it came from, for people: a folder, or ORG/NAME@commit
    record: dict[str, Optional[str]]  # what the state records (prestart installs it again)


@dataclass(frozen=True)
class Exported:
    name: str
    folder: Path
    replaced: bool  # a variant of that name was there before


def export(result: BuildResult, sources: dict[str, bytes], dest: Path) -> Exported:
    """Write `dest/build/<variant>/` for a published build and the sources it was built
    from: staged beside it and renamed into place (an older variant of the name is
    replaced whole). Variants of other ABIs already in `dest` are left as they are."""
    manifest = result.manifest
    hashes = {n: sha256_bytes(d) for n, d in sorted(sources.items()) if n in KERNEL_FILES}
    if hashes != manifest["inputs"]["sources"]:
        raise SourceError(
            f"the sources at hand are not those build {result.key[:12]} was made from",
            fix="run the export again (it rebuilds for the sources given)",
        )
    name = variant_name(manifest["inputs"], manifest["cuda"])
    parent = dest / BUILD_DIRNAME
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    try:
        shutil.copyfile(result.so, staging / SO_FILE)
        if sha256_file(staging / SO_FILE) != manifest["so_sha256"]:
            raise CacheError.failing(
                "prebuilt.export",
                f"{result.so} does not match the sha256 in its manifest",
                f"rebuild it: `qwen-kvprep build --force --export {dest}`",
                [result.so],
            )
        for source_name, data in sources.items():
            if source_name in hashes:
                (staging / source_name).write_bytes(data)
        metadata: VariantMetadata = {
            "metadata_version": METADATA_VERSION,
            "variant": name,
            "key": result.key,
            "manifest": manifest,
            "sources": hashes,
            "files": {SO_FILE: manifest["so_sha256"], **hashes},
        }
        text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"
        (staging / METADATA).write_text(text, encoding="utf-8")
        os.chmod(staging, 0o755)
        final = parent / name
        replaced = os.path.lexists(final)
        if replaced:
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=parent))
            os.rename(final, old / "variant")
            os.rename(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Exported(name, final, replaced)

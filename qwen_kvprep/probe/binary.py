"""Which GPU code a built CUDA extension really carries, read from the binary itself.

nvcc embeds device code in "fatbin" containers: in a linked ELF object they sit in the
`.nv_fatbin` section (relocatable device code: `__nv_relfatbin`). Each container is a
16-byte header (magic 0xBA55ED50, version, header size, size of the entries) followed by
entries, each with its own header:

    offset  size  field
    0       2     kind: 1 = PTX, 2 = ELF (SASS)
    2       2     entry format version
    4       4     header size
    8       8     padded payload size (the next entry starts after header + this)
    28      4     architecture, e.g. 80 for sm_80 / compute_80
    40      8     flags: 0x100000 = arch-specific ("sm_90a"), 0x200000 = family ("sm_100f")

(layout as cuobjdump reports it; the flag bits were confirmed with nvcc 13.0 by compiling
the same kernel with and without the suffixes). Payloads may be compressed; only the
headers are read, so no decompression and no cuobjdump are needed.

The driver runs SASS built for sm_XY on a GPU of the same major capability with a minor
≥ Y ("a" variants: only the exact capability), and JIT-compiles PTX for compute_XY on any
GPU ≥ X.Y. `runs_on` encodes that rule.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

FATBIN_MAGIC = 0xBA55ED50
_MAGIC_BYTES = struct.pack("<I", FATBIN_MAGIC)
_FATBIN_SECTIONS = (b".nv_fatbin", b"__nv_relfatbin")
_KIND = {1: "ptx", 2: "sass"}
_Buf = Union[bytes, mmap.mmap]
_FLAG_ARCH_SPECIFIC = 0x100000
_FLAG_FAMILY = 0x200000
# Entries with an implausible header are ignored rather than trusted (a magic number
# inside unrelated data, a truncated file).
_MIN_ENTRY_HEADER = 48
_MAX_ENTRY_HEADER = 4096


@dataclass(frozen=True, order=True)
class CodeEntry:
    """One piece of device code: SASS for sm_XY or PTX for compute_XY."""

    arch: int  # 80 for 8.0, 120 for 12.0
    kind: str  # "sass" | "ptx"
    variant: str = ""  # "" | "a" (only this exact GPU) | "f" (this family)

    @property
    def capability(self) -> tuple[int, int]:
        return divmod(self.arch, 10)

    @property
    def label(self) -> str:
        prefix = "sm" if self.kind == "sass" else "compute"
        return f"{prefix}_{self.arch}{self.variant}"


@dataclass(frozen=True)
class BinaryArchs:
    """The device code found in one file (`error` set when it could not be read)."""

    path: str
    entries: tuple[CodeEntry, ...] = ()
    error: Optional[str] = None

    @property
    def has_device_code(self) -> bool:
        return bool(self.entries)

    def labels(self) -> list[str]:
        return [e.label for e in self.entries]


def parse_arch_label(label: str) -> Optional[CodeEntry]:
    """`sm_80` / `compute_90` / `sm_90a` (as torch and cuobjdump write them) to an entry."""
    m = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", label.strip())
    if not m:
        return None
    return CodeEntry(int(m.group(2)), "sass" if m.group(1) == "sm" else "ptx", m.group(3))


def runs_on(entries: Iterable[CodeEntry], capability: tuple[int, int]) -> Optional[CodeEntry]:
    """The entry the driver would use on a GPU of `capability`, or None ("no kernel image")."""
    major, minor = capability
    cc = major * 10 + minor
    best: Optional[CodeEntry] = None
    for e in entries:
        emaj, emin = e.capability
        if e.kind == "sass":
            if e.variant == "a":
                usable = (emaj, emin) == (major, minor)
            else:
                usable = emaj == major and emin <= minor
        else:
            if e.variant == "a":
                usable = (emaj, emin) == (major, minor)
            elif e.variant == "f":
                usable = emaj == major and emin <= minor
            else:
                usable = e.arch <= cc
        if not usable:
            continue
        # The driver prefers matching SASS over JIT-compiling PTX.
        if best is None or (e.kind == "sass", e.arch) > (best.kind == "sass", best.arch):
            best = e
    return best


def _elf_sections(data: _Buf) -> Optional[list[tuple[bytes, int, int]]]:
    """(name, offset, size) of every section of a little-endian ELF file, else None."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[5] != 1:
        return None
    is64 = data[4] == 2
    try:
        if is64:
            shoff = struct.unpack_from("<Q", data, 0x28)[0]
            shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        else:
            shoff = struct.unpack_from("<I", data, 0x20)[0]
            shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x2E)
        raw: list[tuple[int, int, int]] = []
        for i in range(shnum):
            base = shoff + i * shentsize
            if is64:
                name_off = struct.unpack_from("<I", data, base)[0]
                offset, size = struct.unpack_from("<QQ", data, base + 0x18)
            else:
                name_off = struct.unpack_from("<I", data, base)[0]
                offset, size = struct.unpack_from("<II", data, base + 0x10)
            raw.append((name_off, offset, size))
        if not raw or shstrndx >= len(raw):
            return None
        _, str_off, str_size = raw[shstrndx]
        strtab = bytes(data[str_off : str_off + str_size])
    except struct.error:
        return None
    out = []
    for name_off, offset, size in raw:
        end = strtab.find(b"\0", name_off)
        out.append((strtab[name_off : end if end >= 0 else None], offset, size))
    return out


def _parse_containers(data: _Buf, start: int, end: int) -> set[CodeEntry]:
    found: set[CodeEntry] = set()
    pos = data.find(_MAGIC_BYTES, start, end)
    while pos >= 0:
        nxt = pos + 4
        try:
            _, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
            p = pos + header_size
            stop = min(p + fat_size, end)
            while p + _MIN_ENTRY_HEADER <= stop:
                kind, _ev, ehs, padded = struct.unpack_from("<HHIQ", data, p)
                if kind not in _KIND or not _MIN_ENTRY_HEADER <= ehs <= _MAX_ENTRY_HEADER:
                    break
                arch = struct.unpack_from("<I", data, p + 28)[0]
                flags = struct.unpack_from("<Q", data, p + 40)[0]
                variant = (
                    "a" if flags & _FLAG_ARCH_SPECIFIC else "f" if flags & _FLAG_FAMILY else ""
                )
                if 10 <= arch < 1000:
                    found.add(CodeEntry(arch, _KIND[kind], variant))
                p += ehs + padded
            nxt = max(nxt, min(p, stop))
        except struct.error:
            pass
        pos = data.find(_MAGIC_BYTES, nxt, end)
    return found


def read_archs(path: Path) -> BinaryArchs:
    """Read the device code a shared object or object file carries. Never raises."""
    try:
        with open(path, "rb") as fh:
            try:
                data: _Buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                data = b""
            try:
                sections = _elf_sections(data)
                if sections is None:
                    return BinaryArchs(str(path), error="not an ELF shared object")
                entries: set[CodeEntry] = set()
                for name, offset, size in sections:
                    if name in _FATBIN_SECTIONS:
                        entries |= _parse_containers(data, offset, min(offset + size, len(data)))
                return BinaryArchs(str(path), tuple(sorted(entries)))
            finally:
                if isinstance(data, mmap.mmap):
                    data.close()
    except OSError as exc:
        return BinaryArchs(str(path), error=f"cannot read: {exc.strerror or exc}")

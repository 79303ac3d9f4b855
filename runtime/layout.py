"""Where every byte of one served rank goes: the files of the rank, placed in one allocation.

The allocation holds whole files, headers included, back to back (each file starting at a
multiple of ``REGION_ALIGN``)::

    [0, S0)                    rank-{r:02d}-of-{T:02d}.safetensors
    [align(S0), align(S0)+S1)  common.safetensors   (only if the manifest lists it)

so a tensor is the view ``[region offset + its file offset, + nbytes)``. Copying whole files
keeps the fill one sequential read per file, and the sha256 of each region equals the
manifest's checksum of the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack.errors import CorruptFileError, ProtocolError, UsageError, VerificationError
from mpack.sidecar import (
    COMMON_NAME,
    DTYPE_SIZES,
    MAX_HEADER,
    TensorEntry,
    TensorSpec,
    load_manifest,
    rank_file_name,
    read_layout,
    regenerate_hint,
)

REGION_ALIGN = 4096


@dataclass(frozen=True)
class Region:
    """One sidecar file in the allocation: bytes ``[offset, offset + size)``."""

    name: str  # file name inside the sidecar
    path: Path
    offset: int
    size: int
    sha256: str | None  # from the manifest (format version 2: absent where chunks are listed)
    head: bytes  # the file's first 8 + header-length bytes, as parsed when planning
    chunk_bytes: int = 0  # > 0: the manifest lists per-chunk sha256 (Note [chunk digests])
    chunk_sha256: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Everything needed to fill and describe one rank's allocation, known before any data moves.

    ``tensors`` are ``TensorEntry`` s whose ``offset`` is relative to the allocation.
    """

    sidecar: Path
    manifest: dict[str, Any]
    digest: str
    rank: int
    tp_size: int
    regions: list[Region]
    tensors: list[TensorEntry]
    size: int  # bytes used (end of the last region)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _read_head(path: Path) -> bytes:
    with open(path, "rb") as f:
        prefix = f.read(8)
        (n,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (0,)
        return prefix + f.read(min(n, MAX_HEADER))


def check_rank(manifest: dict[str, Any], rank: int) -> int:
    """The sidecar's TP size, after checking ``0 <= rank < tp_size``."""
    tp = manifest["target"]["tp_size"]
    if type(tp) is not int or tp < 1:
        raise CorruptFileError(f"manifest target tp_size is {tp!r}, not a positive integer")
    if not 0 <= rank < tp:
        raise UsageError(f"rank {rank} is out of range: this sidecar has tp_size={tp}")
    return tp


def check_entry(e: TensorEntry, size: int, where: str) -> None:
    """A tensor must lie inside the allocation (alignment: Note [unaligned tail tensors])."""
    if e.offset < 0 or e.offset + e.nbytes > size:
        raise CorruptFileError(
            f"{where}: tensor {e.name!r} [{e.offset}, +{e.nbytes}) is outside {size} bytes"
        )


def plan_rank(sidecar: str | os.PathLike, rank: int) -> Plan:
    """Validate the manifest and file headers of one rank and place its files.

    Raises:
        FormatVersionError, CorruptFileError: from the manifest or a file header.
        UsageError: ``rank`` outside the sidecar's TP size.
        VerificationError: a file whose size differs from the manifest.
    """
    sidecar = Path(sidecar)
    manifest, digest = load_manifest(sidecar)
    tp = check_rank(manifest, rank)
    listed = {f["name"]: f for f in manifest["files"]}
    names = [rank_file_name(rank, tp)] + ([COMMON_NAME] if COMMON_NAME in listed else [])
    src = manifest["source"]
    hint = "regenerate it: " + regenerate_hint(src.get("repo") or src.get("path"), sidecar)
    regions: list[Region] = []
    tensors: list[TensorEntry] = []
    seen: dict[str, str] = {}
    offset = 0
    for name in names:
        if name not in listed:
            raise CorruptFileError(f"{sidecar}: the manifest does not list {name}", hint=hint)
        path = sidecar / name
        layout = read_layout(path)
        if layout.size != listed[name]["size"]:
            raise VerificationError(
                f"{path}: {layout.size} bytes, the manifest says {listed[name]['size']}", hint=hint
            )
        offset = _align(offset, REGION_ALIGN)
        chunks = listed[name].get("chunks") or {}
        regions.append(
            Region(
                name,
                path,
                offset,
                layout.size,
                listed[name].get("sha256"),
                _read_head(path),
                chunks.get("bytes", 0),
                tuple(chunks.get("sha256", ())),
            )  # fmt: skip
        )
        for e in layout.entries:
            if e.name in seen:
                raise CorruptFileError(
                    f"{sidecar}: tensor {e.name!r} is in both {seen[e.name]} and {name}"
                )
            seen[e.name] = name
            tensors.append(TensorEntry(e.name, e.dtype, e.shape, offset + e.offset, e.nbytes))
        offset += layout.size
    for e in tensors:
        check_entry(e, offset, str(sidecar))
    return Plan(sidecar, manifest, digest, rank, tp, regions, tensors, offset)


# --- on the wire -------------------------------------------------------------------------------


def tensors_to_wire(tensors: list[TensorEntry]) -> list[list[Any]]:
    """``[[name, dtype, shape, offset], ...]`` (nbytes follows from dtype and shape)."""
    return [[e.name, e.dtype, list(e.shape), e.offset] for e in tensors]


def tensors_from_wire(items: Any, size: int) -> list[TensorEntry]:
    """Parse and check a daemon's tensor list against an allocation of ``size`` bytes.

    Raises:
        ProtocolError: anything malformed, out of range or misaligned.
    """
    if not isinstance(items, list):
        raise ProtocolError("daemon sent no tensor list")
    out = []
    for it in items:
        try:
            name, dtype, shape, offset = it
            ok = (
                isinstance(name, str)
                and dtype in DTYPE_SIZES
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and type(offset) is int
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ProtocolError(f"daemon sent a malformed tensor entry {str(it)[:200]}")
        e = TensorEntry(
            name, dtype, tuple(shape), offset, TensorSpec(name, dtype, tuple(shape)).nbytes
        )
        try:
            check_entry(e, size, "daemon layout")
        except CorruptFileError as err:
            raise ProtocolError(str(err)) from None
        out.append(e)
    return out

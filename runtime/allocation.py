"""Where every byte of one served rank goes: the files of the rank, placed in one allocation.

The allocation holds whole files, headers included, back to back (each file starting at a
multiple of ``REGION_ALIGN``)::

    [0, S0)                    rank-{r:02d}-of-{T:02d}.safetensors
    [align(S0), align(S0)+S1)  common.safetensors   (only if the manifest lists it)

so a tensor is the view ``[region offset + its file offset, + nbytes)``. Copying whole files
keeps the fill one sequential read per file, checked chunk by chunk against the manifest's
digests of the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack.errors import CorruptFileError, ProtocolError, UsageError, VerificationError
from mpack.sidecar import (
    COMMON_NAME,
    DTYPE_SIZES,
    TensorEntry,
    TensorSpec,
    load_manifest,
    rank_file_name,
    rank_tensor_problems,
    read_file_map,
    regenerate_hint_of,
)

REGION_ALIGN = 4096


@dataclass(frozen=True)
class Region:
    """One sidecar file in the allocation: bytes ``[offset, offset + size)``."""

    name: str  # file name inside the sidecar
    path: Path
    offset: int
    size: int
    head: bytes  # the file's first 8 + header-length bytes, as parsed when planning
    chunk_bytes: int  # the file's sha256 digests, one per chunk (Note [chunk digests])
    chunk_sha256: tuple[str, ...]


def _chunks(entry: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    """A files entry's digests as chunks; a version-1 entry without them is one whole-file chunk."""
    if entry.get("chunks"):
        return entry["chunks"]["bytes"], tuple(entry["chunks"]["sha256"])
    return max(entry["size"], 1), (entry["sha256"],)


@dataclass(frozen=True)
class Allocation:
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


def check_rank(manifest: dict[str, Any], rank: int) -> int:
    """The sidecar's TP size, after checking that ``rank`` is an int with ``0 <= rank < tp_size``
    (every path to a rank's weights passes here: load, serve, attach)."""
    if type(rank) is not int:
        raise UsageError(f"rank must be an int, got {rank!r}")
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


def plan_rank(sidecar: str | os.PathLike, rank: int) -> Allocation:
    """Validate the manifest and file headers of one rank and place its files.

    Every check ``mpack verify`` makes of the structure is made here too (a loader is no less
    strict than the verifier): the manifest's bounds, regular files only, headers whose shapes
    and offsets are non-negative integers, and rank files holding exactly the tensors the
    manifest's layers imply. The bytes are checked against their digests while they load.

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
    hint = regenerate_hint_of(manifest, sidecar)
    regions: list[Region] = []
    tensors: list[TensorEntry] = []
    seen: dict[str, str] = {}
    offset = 0
    for name in names:
        if name not in listed:
            raise CorruptFileError(f"{sidecar}: the manifest does not list {name}", hint=hint)
        path = sidecar / name
        file_map = read_file_map(path, follow=False)
        if name != COMMON_NAME and (bad := rank_tensor_problems(file_map, manifest, name)):
            # the same structural rule `mpack verify` applies (FORMAT.md): a rank file holds
            # exactly the tensors the manifest's layers imply
            raise CorruptFileError(
                f"{path}: its tensors differ from what the manifest's layers imply: "
                + "; ".join(bad[:3])
                + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""),
                hint=hint,
            )
        if file_map.size != listed[name]["size"]:
            raise VerificationError(
                f"{path}: {file_map.size} bytes, the manifest says {listed[name]['size']}",
                hint=hint,
            )
        offset = _align(offset, REGION_ALIGN)
        regions.append(
            Region(name, path, offset, file_map.size, file_map.header, *_chunks(listed[name]))
        )
        for e in file_map.entries:
            if e.name in seen:
                raise CorruptFileError(
                    f"{sidecar}: tensor {e.name!r} is in both {seen[e.name]} and {name}"
                )
            seen[e.name] = name
            tensors.append(TensorEntry(e.name, e.dtype, e.shape, offset + e.offset, e.nbytes))
        offset += file_map.size
    for e in tensors:
        check_entry(e, offset, str(sidecar))
    return Allocation(sidecar, manifest, digest, rank, tp, regions, tensors, offset)


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
            check_entry(e, size, "daemon tensor table")
        except CorruptFileError as err:
            raise ProtocolError(str(err)) from None
        out.append(e)
    return out

"""Where every byte of one served rank goes: the files of the rank, placed in one allocation.

The allocation of a whole rank holds whole files, headers included, back to back (each file
starting at a multiple of ``REGION_ALIGN``)::

    [0, S0)                    rank-{r:02d}-of-{T:02d}.safetensors
    [align(S0), align(S0)+S1)  common.safetensors   (only if the manifest lists it)

so a tensor is the view ``[region offset + its file offset, + nbytes)``. Copying whole files
keeps the fill one sequential read per file, checked chunk by chunk against the manifest's
digests of the file.

Note [a stage's allocation]: a daemon or a private load of one pipeline stage
(:class:`mpack.arch.Stage`, ``serve --pp-rank``) holds only the tensors that stage builds
(:func:`mpack.arch.stage_holds`): of each file, the runs of those tensors that lie next to each
other in the file (a stage's Marlin tensors are one run of its rank file: Note [a layer range
per stage] in docs/FORMAT.md; its pass-through tensors a few runs of ``common.safetensors``),
each run a :class:`Window` placed after the last at the next offset congruent to its file
offset modulo ``WINDOW_ALIGN``, so every tensor keeps its alignment. The bytes are checked as
for a whole file: every manifest chunk a window touches, and the chunks of the header (whose
parse placed the windows), are read whole and hashed; only the windows' bytes are kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack import arch
from mpack.arch import Stage
from mpack.errors import CorruptFileError, ProtocolError, UsageError, VerificationError
from mpack.sidecar import (
    COMMON_NAME,
    DTYPE_SIZES,
    TensorEntry,
    TensorSpec,
    expected_rank_tensors,
    load_manifest,
    rank_file_name,
    rank_tensor_problems,
    read_file_map,
    regenerate_hint_of,
)

REGION_ALIGN = 4096
#: A window of a stage's allocation starts at this alignment modulo its offset in its file
#: (Note [a stage's allocation]): every tensor of a sidecar is 64-aligned in its file, or an
#: odd-sized tail whose misalignment is kept (Note [unaligned tail tensors] in weights.py).
WINDOW_ALIGN = 64


@dataclass(frozen=True)
class Window:
    """Bytes ``[start, end)`` of a file, at ``at`` in the allocation."""

    start: int
    end: int
    at: int

    def alloc(self, pos: int) -> int:
        """Where file byte ``pos`` (inside the window) is in the allocation."""
        return self.at + pos - self.start


@dataclass(frozen=True)
class Region:
    """One sidecar file in the allocation: bytes ``[offset, offset + size)``."""

    name: str  # file name inside the sidecar
    path: Path
    offset: int  # where the file's first held byte is in the allocation
    size: int  # the file's size
    head: bytes  # the file's first 8 + header-length bytes, as parsed when planning
    chunk_bytes: int  # the file's sha256 digests, one per chunk (Note [chunk digests])
    chunk_sha256: tuple[str, ...]
    #: The file's bytes held (Note [a stage's allocation]); None: the whole file, at ``offset``.
    windows: tuple[Window, ...] | None = None

    @property
    def held(self) -> tuple[Window, ...]:
        """Every window of the file the allocation holds (one for a whole file)."""
        return self.windows or (Window(0, self.size, self.offset),)

    def window_of(self, pos: int, n: int) -> Window | None:
        """The window that holds all of bytes ``[pos, pos + n)``, or None."""
        return next((w for w in self.held if w.start <= pos and pos + n <= w.end), None)

    def overlaps(self, pos: int, n: int) -> list[tuple[int, int, int]]:
        """``(file start, file end, allocation offset)`` of every held part of bytes
        ``[pos, pos + n)``."""
        out = []
        for w in self.held:
            lo, hi = max(pos, w.start), min(pos + n, w.end)
            if lo < hi:
                out.append((lo, hi, w.alloc(lo)))
        return out

    def needs(self, pos: int, n: int) -> bool:
        """Whether a chunk ``[pos, pos + n)`` must be read: it holds kept bytes, or header
        bytes (which are checked against what was parsed)."""
        return pos < len(self.head) or bool(self.overlaps(pos, n))


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
    #: The pipeline stage held (Note [a stage's allocation]); None: the whole rank.
    stage: Stage | None = None

    @property
    def pp_rank(self) -> int | None:
        """The index of the pipeline stage held; None: the whole rank."""
        return None if self.stage is None else self.stage.rank


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


def plan_rank(sidecar: str | os.PathLike, rank: int, stage: Stage | None = None) -> Allocation:
    """Validate the manifest and file headers of one rank and place its files: whole, or for
    ``stage`` only the tensors that pipeline stage builds (Note [a stage's allocation]; a
    ``stage`` of one stage is the whole rank).

    Every check ``mpack verify`` makes of the structure is made here too (a loader is no less
    strict than the verifier): the manifest's bounds, regular files only, headers whose shapes
    and offsets are non-negative integers, and rank files holding exactly the tensors the
    manifest's layers imply. The bytes are checked against their digests while they load.

    Raises:
        FormatVersionError, CorruptFileError: from the manifest or a file header.
        UsageError: ``rank`` outside the sidecar's TP size; a ``stage`` whose split does not
            add up to the model's decoder layers.
        VerificationError: a file whose size differs from the manifest.
    """
    sidecar = Path(sidecar)
    manifest, digest = load_manifest(sidecar)
    tp = check_rank(manifest, rank)
    stage = Stage.partial(stage)
    holds = None if stage is None else stage_rule(manifest, stage, sidecar)
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
        for e in file_map.entries:
            if e.name in seen:
                raise CorruptFileError(
                    f"{sidecar}: tensor {e.name!r} is in both {seen[e.name]} and {name}"
                )
            seen[e.name] = name
        chunks = _chunks(listed[name])
        if holds is None:
            offset = _align(offset, REGION_ALIGN)
            regions.append(Region(name, path, offset, file_map.size, file_map.header, *chunks))
            for e in file_map.entries:
                tensors.append(TensorEntry(e.name, e.dtype, e.shape, offset + e.offset, e.nbytes))
            offset += file_map.size
            continue
        kept = [e for e in file_map.entries if holds(e.name, name)]
        windows, offset = _windows(file_map.entries, kept, offset)
        if windows:
            region = Region(
                name, path, windows[0].at, file_map.size, file_map.header, *chunks, windows
            )
            regions.append(region)
            for e in kept:
                at = region.window_of(e.offset, e.nbytes)
                assert at is not None  # every kept tensor is in a window
                tensors.append(TensorEntry(e.name, e.dtype, e.shape, at.alloc(e.offset), e.nbytes))
    for e in tensors:
        check_entry(e, offset, str(sidecar))
    return Allocation(sidecar, manifest, digest, rank, tp, regions, tensors, offset, stage)


def sidecar_stage(
    manifest: dict[str, Any],
    where: Any,
    pp_rank: int,
    pp_size: int,
    partition: str | None = None,
) -> Stage:
    """Stage ``pp_rank`` of vLLM's split of this sidecar's model over ``pp_size`` stages
    (``partition``: :data:`mpack.arch.PP_PARTITION_ENV`'s value, read as vLLM reads it).

    Raises:
        UsageError: a stage outside the split, a bad ``partition``, or a manifest that records
            no ``num_hidden_layers``.
    """
    layers = ((manifest.get("model") or {}).get("config") or {}).get("num_hidden_layers")
    if type(layers) is not int or layers < 0:
        raise UsageError(
            f"{where}: its manifest records no num_hidden_layers, so its pipeline stages are "
            "not known",
            hint="serve the whole rank (leave out --pp-rank and --pp-size)",
        )
    return Stage.of(layers, pp_rank, pp_size, partition)


def stage_rule(manifest: dict[str, Any], stage: Stage, where: Path) -> Any:
    """``holds(tensor name, file name)``: whether ``stage`` of this sidecar's model holds a
    tensor (:func:`mpack.arch.stage_holds`; a rank file's tensors are those of the manifest's
    layers the stage runs, :func:`mpack.arch.stage_layers`).

    Raises:
        UsageError: the stage's split is not of the model's decoder layers.
    """
    model = manifest.get("model") or {}
    config = model.get("config") or {}
    layers = config.get("num_hidden_layers")
    if sum(stage.split) != layers:
        raise UsageError(
            f"{where}: {stage} splits {sum(stage.split)} decoder layers; the model has {layers}",
            hint="give the split of this model's layers (--pp-size, VLLM_PP_LAYER_PARTITION)",
        )
    lay = arch.layout_of(model.get("architecture"), model.get("text_architecture"))
    tied = config.get("tie_word_embeddings")
    tied = tied if isinstance(tied, bool) else None
    runs = arch.stage_layers(manifest["layers"], stage.layers, lay.decoder_prefix)
    ranked = expected_rank_tensors({**manifest, "layers": runs})

    def holds(name: str, file: str) -> bool:
        if file != COMMON_NAME:
            return name in ranked
        return arch.stage_holds(lay.vllm_name(name), lay, stage, tied)

    return holds


def _windows(
    entries: list[TensorEntry], kept: list[TensorEntry], offset: int
) -> tuple[tuple[Window, ...], int]:
    """The windows of a file holding ``kept`` of its ``entries`` (file offsets): each run of
    kept tensors with no other tensor between, placed from allocation ``offset`` on (Note [a
    stage's allocation]); and the allocation's end after them."""
    keep = {e.name for e in kept}
    runs: list[list[int]] = []
    prev_kept = False
    for e in sorted(entries, key=lambda e: e.offset):
        held = e.name in keep
        if held and prev_kept:
            runs[-1][1] = max(runs[-1][1], e.offset + e.nbytes)
        elif held:
            runs.append([e.offset, e.offset + e.nbytes])
        prev_kept = held
    windows = []
    for start, end in runs:
        at = offset + (start - offset) % WINDOW_ALIGN
        windows.append(Window(start, end, at))
        offset = at + end - start
    return tuple(windows), offset


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

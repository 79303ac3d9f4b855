"""A sidecar against its source checkpoint: every tensor re-derived, and the layout read backwards.

Given the source checkpoint (a directory or Hub repo id passed in; else the local path the
manifest records, or the Hub repo and commit it records, found in the local Hugging Face cache
without any network call; :func:`find_source`), :func:`rederive`

* checks the source files against the digests the manifest records;
* re-derives every Marlin tensor from the checkpoint (the same :mod:`mpack.convert.transform`
  a conversion runs) and compares it byte for byte, and compares the pass-through tensors with
  their source bytes;
* reads the layout backwards: unpacking each weight gives back the fused checkpoint bytes (for
  ``w8a8-marlin`` tensor layers, the requantized bytes), and unpacking each scale (and bias)
  gives back the checkpoint's values cast to the activation dtype.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from mpack.convert import marlin
from mpack.convert.checkpoint import Checkpoint, find_layers, open_checkpoint
from mpack.convert.plan import OutLayer, make_plan
from mpack.convert.source import (
    ResolvedSource,
    cached_source,
    hash_sources,
    record_forms,
    resolve_source,
)
from mpack.convert.transform import fuse, pack, read_unit
from mpack.errors import CorruptFileError, SourceNotFoundError
from mpack.fsutil import open_regular_file
from mpack.iokit import pread_pieces
from mpack.sidecar import COMMON_NAME, FileLayout, rank_file_name, torch_dtype
from mpack.target import act_dtype

__all__ = ["find_source", "rederive"]


def find_source(
    source: str | None, revision: str | None, m: dict[str, Any]
) -> tuple[ResolvedSource | None, str | None]:
    """The source to re-derive from, or None and why not (for people).

    Args:
        source: a directory as it is, or a Hub repo id at ``revision``, else at the commit the
            manifest records (for a Hub-sourced sidecar), else at ``main``. None: the source the
            manifest records, if it is here (:func:`_recorded_source`).

    Raises:
        SourceNotFoundError, UsageError: ``source`` cannot be resolved.
    """
    if source is None:
        return _recorded_source(m)
    rec = m["source"]
    hub_rev = rec.get("revision") if rec.get("kind") == "hub" else None
    local = Path(source).expanduser().exists()
    return resolve_source(source, revision or (None if local else hub_rev)), None


def _recorded_source(m: dict[str, Any]) -> tuple[ResolvedSource | None, str | None]:
    """The source the manifest records, if it is here: a local directory that still exists, or
    a Hub repo at its recorded commit in the local HF cache (never downloaded: verify makes no
    network call without a given source). Else None, and why, for people."""
    rec = m["source"]
    kind, path = rec.get("kind"), rec.get("path")
    repo, rev = rec.get("repo"), rec.get("revision")
    if kind == "hub" and isinstance(repo, str) and isinstance(rev, str) and repo and rev:
        try:
            return cached_source(repo, rev), None
        except SourceNotFoundError as e:
            return None, (
                f"source not checked: {e.message} (looked offline); only the files were "
                f"checked. To re-derive every tensor, download it (hf download {repo} "
                f"--revision {rev}) or pass --source DIR"
            )
    if kind == "local" and isinstance(path, str) and path:
        if Path(path).is_dir():
            return resolve_source(path), None
        return None, (
            f"source not checked: the recorded source directory {path} is not there; only the "
            "files were checked. Pass --source DIR (or a Hub repo id) to re-derive every tensor"
        )
    return None, (
        "source not checked: the manifest records no source mpack can find; only the files "
        "were checked. Pass --source DIR (or a Hub repo id) to re-derive every tensor"
    )


def _read(f: BinaryIO, layout: FileLayout, name: str) -> torch.Tensor:
    """Tensor ``name`` of the sidecar file ``f``, read into a new CPU tensor (a single ``pread``
    returns at most 2 GiB: :func:`mpack.iokit.pread_pieces` reads it whole)."""
    e = layout.entry(name)
    out = torch.empty(e.nbytes, dtype=torch.uint8)  # every byte is read below
    short = pread_pieces(f.fileno(), [(memoryview(out.numpy()), e.offset)])
    if short is not None:
        raise CorruptFileError(f"tensor {name!r} of a sidecar file is truncated at byte {short}")
    return out.view(torch_dtype(e.dtype)).reshape(e.shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def rederive(sidecar: Path, m: dict[str, Any], layouts: dict[str, FileLayout],
             src: ResolvedSource, problems: list[str]) -> tuple[int, int]:  # fmt: skip
    """Re-derive every tensor of ``sidecar`` from ``src``, appending what differs to ``problems``;
    each sidecar file is opened once.

    Args:
        layouts: the sidecar's files (rank files and ``common.safetensors``) by name, as read.

    Returns:
        ``(layers checked, tensors compared)``; layers count once per rank.
    """
    with contextlib.ExitStack() as stack:
        files = {
            n: stack.enter_context(open_regular_file(sidecar / n, buffering=0)) for n in layouts
        }
        return _compare(files, m, layouts, src, problems)


def _check_source_files(src: ResolvedSource, m: dict[str, Any], problems: list[str]) -> None:
    """The source's files against the digests the manifest records of them."""
    recorded = {f["name"]: f for f in m["source"].get("files", [])}
    forms = record_forms(list(recorded.values()))
    for rec in hash_sources(src, sorted(recorded), forms=forms) if recorded else []:
        if rec != recorded[rec["name"]]:
            problems.append(
                f"source {rec['name']}: differs from the file the sidecar was made from"
            )


def _compare(files: dict[str, BinaryIO], m: dict[str, Any], layouts: dict[str, FileLayout],
             src: ResolvedSource, problems: list[str]) -> tuple[int, int]:  # fmt: skip
    t = m["target"]
    ck = open_checkpoint(src.path)
    find_layers(ck)
    _check_source_files(src, m, problems)
    plan = make_plan(ck, profile=t["profile"], act_dtype=t["act_dtype"], tp=t["tp_size"],
                     fusion=t["fusion"], passthrough=COMMON_NAME in layouts)  # fmt: skip
    compared = 0
    for unit in plan.units:
        data = read_unit(ck, unit)
        for layer in unit:
            fname = rank_file_name(layer.rank, plan.tp)
            compared += _compare_layer(files[fname], layouts[fname], fname, layer, data,
                                       t["act_dtype"], problems)  # fmt: skip
    if COMMON_NAME in layouts:
        compared += _compare_passthrough(
            files[COMMON_NAME], layouts[COMMON_NAME], ck, plan.passthrough, problems
        )
    return len(plan.units) * plan.tp, compared


def _compare_layer(f: BinaryIO, layout: FileLayout, fname: str, layer: OutLayer,
                   data: dict[str, torch.Tensor], act: str,
                   problems: list[str]) -> int:  # fmt: skip
    """One rank's packed layer: re-derived byte for byte, and unpacked back to the checkpoint's
    values. Returns the number of tensors compared."""
    fused = fuse(layer, data)
    specs = layer.tensor_specs(act)
    got = [_read(f, layout, spec.name) for spec in specs]
    for spec, g, w in zip(specs, got, pack(layer, fused, act), strict=True):
        if not _same(g, w):
            problems.append(
                f"{fname}: {spec.name} differs from the tensor re-derived from the source"
            )
    dt = torch_dtype(act_dtype(act).st)
    if not _same(marlin.unpack_weight(got[0], layer.n, layer.k), fused.weight):
        what = "requantized" if layer.requant else "checkpoint"
        problems.append(f"{fname}: {layer.name}.weight does not unpack to the {what} bytes")
    if not _same(marlin.unpack_scales(got[1], layer.n), fused.scale.to(dt)):
        problems.append(
            f"{fname}: {layer.name}.weight_scale does not unpack to the checkpoint scales"
        )
    if fused.bias is not None and not _same(marlin.unpack_bias(got[2], layer.n), fused.bias.to(dt)):
        problems.append(f"{fname}: {layer.name}.bias does not unpack to the checkpoint bias")
    return len(specs)


def _compare_passthrough(f: BinaryIO, layout: FileLayout, ck: Checkpoint, passthrough: list[str],
                         problems: list[str]) -> int:  # fmt: skip
    """``common.safetensors`` against the source's pass-through tensors, byte for byte. Returns
    the number of tensors compared."""
    names = {e.name for e in layout.entries}
    if names != set(passthrough):
        problems.append(
            f"{COMMON_NAME}: tensor names differ from the source's pass-through tensors"
        )
    both = sorted(names & set(passthrough))
    for name in both:
        if not _same(_read(f, layout, name), ck.read(name)):
            problems.append(f"{COMMON_NAME}: {name} differs from the source bytes")
    return len(both)

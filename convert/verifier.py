"""``mpack verify``: a sidecar checked against its manifest and, given its source, re-derived.

Three levels, each one stricter:

1. every file's size and sha256 against the manifest, every safetensors header parses, and the
   tensor names and shapes are exactly the ones the manifest's layer table implies;
2. with the source checkpoint (``--source``; else the local path the manifest records, or the
   Hub repo and commit it records, found in the local Hugging Face cache without any network
   call): every Marlin tensor is re-derived from the checkpoint and compared byte for byte, and
   pass-through tensors compared with their source bytes. When no source is found, the report's
   ``source_note`` says why and how to get one;
3. the layout read backwards: unpacking each weight gives back the fused checkpoint bytes (for
   ``w8a8-marlin`` tensor layers, the requantized bytes), and unpacking each scale gives back the
   scales cast to the activation dtype.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from mpack.convert import marlin
from mpack.convert.checkpoint import find_layers, open_checkpoint
from mpack.convert.pipeline import fuse, pack
from mpack.convert.plan import make_plan
from mpack.convert.source import (
    ResolvedSource,
    cached_source,
    hash_sources,
    record_forms,
    resolve_source,
)
from mpack.convert.stream import read_unit
from mpack.errors import InputError, SourceNotFoundError, VerificationError
from mpack.fsutil import open_regular_file
from mpack.sidecar import (
    COMMON_NAME,
    FileLayout,
    check_files,
    load_manifest,
    rank_file_name,
    rank_tensor_problems,
    read_layout,
    regenerate_hint_of,
    torch_dtype,
)

MAX_LISTED = 20


def _read(f: BinaryIO, layout: FileLayout, name: str) -> torch.Tensor:
    e = layout.entry(name)
    data = bytearray(os.pread(f.fileno(), e.nbytes, e.offset))
    t = torch.frombuffer(data, dtype=torch.uint8) if e.nbytes else torch.empty(0, dtype=torch.uint8)
    return t.view(torch_dtype(e.dtype)).reshape(e.shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def run_verify(
    sidecar: str | os.PathLike, *, source: str | os.PathLike | None = None
) -> dict[str, Any]:
    """Verify ``sidecar``; return a report, or raise ``VerificationError`` listing every problem."""
    sidecar = Path(sidecar)
    m, digest = load_manifest(sidecar)
    problems = check_files(sidecar, m)
    tp = m["target"]["tp_size"]
    layouts: dict[str, FileLayout] = {}
    listed = {f["name"] for f in m["files"]}
    for name in [rank_file_name(rank, tp) for rank in range(tp)] + [COMMON_NAME]:
        if name not in listed:
            continue  # every rank file is listed (check_manifest); common.safetensors may not be
        try:
            layouts[name] = read_layout(sidecar / name, follow=False)
        except InputError as e:
            problems.append(str(e))
            continue
        if name != COMMON_NAME:
            problems += rank_tensor_problems(layouts[name], m, name)
    report: dict[str, Any] = {
        "sidecar": str(sidecar),
        "digest": digest,
        "files_checked": len(m["files"]),
        "source_checked": False,
        "layers_checked": 0,
        "tensors_compared": 0,
    }

    src, report["source_note"] = (
        (_given_source(str(source), m), None) if source is not None else _recorded_source(m)
    )
    if src is not None and not problems:
        report.update(_against_source(sidecar, m, layouts, src, problems))
    if problems:
        listed = problems[:MAX_LISTED] + (
            [f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else []
        )
        raise VerificationError(
            f"{sidecar}: {len(problems)} problem(s):\n  " + "\n  ".join(listed),
            hint=regenerate_hint_of(m, sidecar),
        )
    return report


def _given_source(source: str, m: dict[str, Any]) -> ResolvedSource:
    """``--source``: a directory as it is; a repo id at the commit the manifest records (for a
    Hub-sourced sidecar), else at ``main``."""
    rec = m["source"]
    hub_rev = rec.get("revision") if rec.get("kind") == "hub" else None
    local = Path(source).expanduser().exists()
    return resolve_source(source, None if local else hub_rev)


def _recorded_source(m: dict[str, Any]) -> tuple[ResolvedSource | None, str | None]:
    """The source the manifest records, if it is here: a local directory that still exists, or
    a Hub repo at its recorded commit in the local HF cache (never downloaded: verify makes no
    network call without ``--source``). Else None, and why, for people."""
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


def _against_source(sidecar: Path, m: dict[str, Any], layouts: dict[str, FileLayout],
                    src: ResolvedSource, problems: list[str]) -> dict[str, Any]:  # fmt: skip
    """Re-derive every tensor from the source; each sidecar file is opened once."""
    with contextlib.ExitStack() as stack:
        files = {
            n: stack.enter_context(open_regular_file(sidecar / n, buffering=0)) for n in layouts
        }
        return _compare(files, m, layouts, src, problems)


def _compare(files: dict[str, BinaryIO], m: dict[str, Any], layouts: dict[str, FileLayout],
             src: ResolvedSource, problems: list[str]) -> dict[str, Any]:  # fmt: skip
    t = m["target"]
    ck = open_checkpoint(src.path)
    find_layers(ck)
    recorded = {f["name"]: f for f in m["source"].get("files", [])}
    forms = record_forms(list(recorded.values()))
    for rec in hash_sources(src, sorted(recorded), forms=forms) if recorded else []:
        if rec != recorded[rec["name"]]:
            problems.append(
                f"source {rec['name']}: differs from the file the sidecar was made from"
            )
    plan = make_plan(ck, profile=t["profile"], act_dtype=t["act_dtype"], tp=t["tp_size"], fusion=t["fusion"],
                     passthrough=COMMON_NAME in layouts)  # fmt: skip
    dt = marlin.ACT_DTYPES[t["act_dtype"]]
    compared = 0
    for unit in plan.units:
        data = read_unit(ck, unit)
        for layer in unit:
            fname = rank_file_name(layer.rank, plan.tp)
            fused = fuse(layer, data)
            specs = layer.tensor_specs(t["act_dtype"])
            got = [_read(files[fname], layouts[fname], spec.name) for spec in specs]
            for spec, g, w in zip(specs, got, pack(layer, fused, t["act_dtype"]), strict=True):
                compared += 1
                if not _same(g, w):
                    problems.append(
                        f"{fname}: {spec.name} differs from the tensor re-derived from the source"
                    )
            if not _same(marlin.unpack_weight(got[0], layer.n, layer.k), fused.weight):
                what = "requantized" if layer.requant else "checkpoint"
                problems.append(f"{fname}: {layer.name}.weight does not unpack to the {what} bytes")
            if not _same(marlin.unpack_scales(got[1], layer.n), fused.scale.to(dt)):
                problems.append(
                    f"{fname}: {layer.name}.weight_scale does not unpack to the checkpoint scales"
                )
            if fused.bias is not None and not _same(
                marlin.unpack_bias(got[2], layer.n), fused.bias.to(dt)
            ):
                problems.append(
                    f"{fname}: {layer.name}.bias does not unpack to the checkpoint bias"
                )
    if COMMON_NAME in layouts:
        names = {e.name for e in layouts[COMMON_NAME].entries}
        if names != set(plan.passthrough):
            problems.append(
                f"{COMMON_NAME}: tensor names differ from the source's pass-through tensors"
            )
        for name in sorted(names & set(plan.passthrough)):
            compared += 1
            if not _same(_read(files[COMMON_NAME], layouts[COMMON_NAME], name), ck.read(name)):
                problems.append(f"{COMMON_NAME}: {name} differs from the source bytes")
    return {"source_checked": True, "source": src.display,
        "source_path": str(src.path), "layers_checked": len(plan.units) * plan.tp,
            "tensors_compared": compared}  # fmt: skip

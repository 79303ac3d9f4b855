"""What binds a sidecar to the checkpoint it was made from, and the check every start can afford.

Note [a sidecar is bound to its checkpoint]: a sidecar's Marlin tensors replace a checkpoint's
FP8 linears. Loaded beside another checkpoint of the same shapes (a fine-tune, another
revision) it would serve the other weights, silently; a ``--no-passthrough`` one would mix the
two (one checkpoint's embeddings, the other's linears). So ``convert`` records, per safetensors
shard in ``source.files``, a ``probe``: the sha256 of the shard's header and of the first and
last :data:`PROBE_BYTES` of every tensor's data (all of a tensor of at most twice that). Any
fine-tune changes some tensor's first or last bytes; a header digest alone would not tell two
fine-tunes of one architecture apart. Whoever knows the checkpoint (the vLLM loader, whose
model argument is the checkpoint; ``mpack.runtime.load`` / ``attach`` given ``checkpoint=``)
calls :func:`check_bound`: the shard names and sizes, the index's digest, and each shard's
probe must be the recorded ones. Reading two small pieces per tensor costs milliseconds where a
full digest of an 8B's 8 GB costs seconds (figures: docs/BENCHMARKS.md, section 14). The check
never needs the network: a Hub checkpoint is its snapshot in the local HF cache, and one at the
commit the manifest records is bound by that commit (a commit names its files' content) even
before its shards are downloaded. ``check_source: false`` (the loader's extra config) or no
``checkpoint=`` skips it, for those who know the pair is right.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpack.errors import InputError, shown
from mpack.iokit import sha256_file
from mpack.sidecar import INDEX_NAME, is_commit  # the index's digest is compared whole

#: Bytes probed at each end of every tensor (Note [a sidecar is bound to its checkpoint]).
PROBE_BYTES = 4096
#: The ``source.files`` key of a shard's probe.
PROBE_KEY = "probe"


class SourceMismatchError(InputError):
    """The checkpoint given is not the one the sidecar was made from."""


def is_shard(name: str) -> bool:
    """A file that gets a probe: a safetensors shard."""
    return name.endswith(".safetensors")


def probe_spans(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges of one tensor that its probe reads: all of it up to ``2 * PROBE_BYTES``,
    else the first and the last ``PROBE_BYTES``."""
    if nbytes <= 2 * PROBE_BYTES:
        return [(offset, offset + nbytes)] if nbytes else []
    end = offset + nbytes
    return [(offset, offset + PROBE_BYTES), (end - PROBE_BYTES, end)]


def probe(path: str | os.PathLike) -> str:
    """The probe of a safetensors file: sha256 of its 8-byte length prefix and header, then of
    :func:`probe_spans` of every tensor in file order (FORMAT.md, ``source.files``)."""
    from mpack.sidecar import read_file_map

    fm = read_file_map(path)
    h = hashlib.sha256(fm.header)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for e in fm.entries:
            for a, b in probe_spans(e.offset, e.nbytes):
                got = os.pread(fd, b - a, a)
                if len(got) != b - a:
                    raise InputError(f"{path}: {e.name} ends past the end of the file")
                h.update(got)
    finally:
        os.close(fd)
    return h.hexdigest()


def _recorded(manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The recorded shards and index of ``manifest``'s source, by name."""
    files = manifest.get("source", {}).get("files", [])
    return {f["name"]: f for f in files if is_shard(f["name"]) or f["name"] == INDEX_NAME}


def _checkpoint_shards(root: Path) -> set[str]:
    """The shards a loader reads from ``root``: the index's, else every ``*.safetensors``."""
    index = root / INDEX_NAME
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return set()  # a broken index differs from the recorded one: its digest says so
    return {p.name for p in root.glob("*.safetensors")}


def _snapshot_commit(root: Path) -> str | None:
    """The commit of an HF cache snapshot directory (``.../snapshots/<commit>``), else None."""
    d = root.resolve()
    return d.name if is_commit(d.name) and d.parent.name == "snapshots" else None


def check_bound(
    manifest: Mapping[str, Any],
    checkpoint: str | os.PathLike,
    revision: str | None = None,
    *,
    where: str | os.PathLike,
    override: str,
) -> None:
    """Refuse a ``checkpoint`` (a directory, or a Hub repo id at ``revision`` in the local HF
    cache: :func:`checkpoint_dir`) that the sidecar at ``where`` was not made from (Note [a
    sidecar is bound to its checkpoint]); ``override`` names the way to skip the check, for the
    message.

    Raises:
        SourceMismatchError: a recorded shard missing or of another size or probe, a shard the
            sidecar was made without, another index, or a sidecar that records no probes.
    """
    root = checkpoint_dir(checkpoint, revision)
    src = manifest.get("source", {})
    if root is None:
        raise SourceMismatchError(
            f"{where}: cannot check that it was made from {shown(str(checkpoint))}: no such "
            "directory, and no snapshot of it in the local HF cache",
            hint=f"download the checkpoint first, or skip the check: {override}",
        )
    recorded = _recorded(manifest)
    hint = (
        f"give the checkpoint this sidecar was made from ({_origin(src)}), or convert this one: "
        f"mpack convert {shown(str(root))} -o SIDECAR; to load them together anyway: {override}"
    )

    def refuse(what: str) -> None:
        raise SourceMismatchError(
            f"{where}: was made from another checkpoint than {shown(str(root))}: {what}",
            hint=hint,
        )

    commit = _snapshot_commit(root)
    if src.get("kind") == "hub" and commit is not None and commit == src.get("revision"):
        return  # the same commit of the same cache entry: the same bytes, named by the commit
    if not recorded:
        refuse("the sidecar records no source shards")
    have = _checkpoint_shards(root)
    for name in sorted(have - set(recorded)):
        refuse(f"the checkpoint has shard {shown(name)}, which the sidecar was not made from")
    for name, rec in sorted(recorded.items()):
        p = root / name
        if not p.is_file():
            missing = "not downloaded" if commit else "missing"
            refuse(f"its {shown(name)} is {missing} (the sidecar was made from one)")
        size = p.stat().st_size
        if size != rec["size"]:
            refuse(f"{shown(name)} is {size} bytes, {rec['size']} in the one it was made from")
        if name == INDEX_NAME:
            if rec.get("sha256") not in (None, sha256_file(p)):
                refuse(f"{shown(name)} differs from the one the sidecar was made from")
            continue
        if PROBE_KEY not in rec:
            raise SourceMismatchError(
                f"{where}: records no probe of source shard {shown(name)} (made by an older "
                "mpack), so it cannot be checked against this checkpoint",
                hint=f"regenerate the sidecar with this mpack, or skip the check: {override}",
            )
        if probe(p) != rec[PROBE_KEY]:
            refuse(f"{shown(name)} holds other weights than the one the sidecar was made from")


def _origin(src: Mapping[str, Any]) -> str:
    if src.get("kind") == "hub":
        return f"{src.get('repo')}@{str(src.get('revision'))[:12]}"
    return str(src.get("path") or "its recorded source")


def checkpoint_dir(checkpoint: str | os.PathLike, revision: str | None = None) -> Path | None:
    """The local directory of a checkpoint given as a directory or a Hub repo id: its snapshot
    in the HF cache (found by its ``config.json``, offline: huggingface_hub's
    ``try_to_load_from_cache``), whatever of it is downloaded; None where there is none."""
    p = Path(checkpoint).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(str(checkpoint), "config.json", revision=revision)
    except ValueError:  # not a repo id either
        return None
    return Path(hit).parent if isinstance(hit, str) else None


__all__ = [
    "PROBE_BYTES",
    "PROBE_KEY",
    "SourceMismatchError",
    "check_bound",
    "checkpoint_dir",
    "is_shard",
    "probe",
    "probe_spans",
]

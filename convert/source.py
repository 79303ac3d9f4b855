"""Where a checkpoint comes from: a local directory, or a Hub repo resolved to an exact commit.

Hub sources go through ``huggingface_hub.snapshot_download`` (revision pinning, the HF cache,
``HF_HUB_OFFLINE``, tokens), fetching only what a conversion needs. The manifest records the
resolved commit (or the local path) and the size and digests of every source file used.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import re
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack.binding import PROBE_KEY, is_shard, probe
from mpack.cache import recalled_source_dir
from mpack.convert.timeline import Timeline
from mpack.errors import (
    ENVIRONMENT_ERRNOS,
    InputError,
    MpackError,
    SourceNotFoundError,
    UsageError,
    arg,
    environment_failure,
    shown,
)
from mpack.fsutil import parse_json, read_capped
from mpack.iokit import (
    HashCancelled,
    chunk_spans,
    hash_range,
    pool,
    sha256_file,
    usable_cores,
)
from mpack.sidecar import (
    CHUNK_BYTES,
    COPIED_FILES,
    INDEX_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST,
    SOURCE_CARD_NAME,
    is_card_fact,
    is_commit,
)

#: What a conversion must have of a repo: the weights, config, tokenizer and template files.
NEEDED_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "merges.txt",
    "vocab.*",
    "*.jinja",
]
#: What it also fetches where it can (Note [optional files]): the copied files no pattern above
#: takes (``recipe.yaml``, the licence files) and the model card, for its licence metadata.
OPTIONAL_PATTERNS = [
    *(n for n in COPIED_FILES if not any(fnmatch.fnmatchcase(n, p) for p in NEEDED_PATTERNS)),
    SOURCE_CARD_NAME,
]
#: Every file a conversion may read from a source (stamped, and checked in a snapshot).
ALLOW_PATTERNS = [*NEEDED_PATTERNS, *OPTIONAL_PATTERNS]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
log = logging.getLogger("mpack.convert.source")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ResolvedSource:
    """A checkpoint on local disk, and how it was named."""

    path: Path  # directory holding config.json and the shards
    kind: str  # "local" | "hub"
    repo: str | None = None  # Hub repo id
    revision: str | None = None  # resolved commit sha (Hub)
    requested: str | None = None  # the revision the user asked for

    @property
    def display(self) -> str:
        return (
            f"{self.repo}@{self.revision[:12]}"
            if self.kind == "hub" and self.revision
            else str(self.path)
        )


def resolve_source(
    source: str, revision: str | None = None, *, show_progress: bool = False
) -> ResolvedSource:
    """Resolve ``source`` (a directory, or a Hub repo id) to a local directory.

    Raises:
        SourceNotFoundError: no such directory, repo, revision, or (offline) nothing cached.
        UsageError: ``revision`` given with a local directory.
    """
    p = Path(source).expanduser()
    if p.exists():
        if not p.is_dir():
            raise SourceNotFoundError(
                f"{source}: is a file; give the checkpoint directory (holding config.json)"
            )
        if revision:
            raise UsageError(
                f"{arg('revision', revision)} applies to Hub repos, but {source} is a local "
                "directory"
            )
        src = ResolvedSource(path=p.resolve(), kind="local")
    elif source.startswith((".", "/", "~")) or not _REPO_ID.match(source):
        raise SourceNotFoundError(f"{source}: no such directory (and not a Hugging Face repo id)")
    else:
        src = _snapshot(source, revision, show_progress)
    refuse_sidecar(src, source)
    return src


def refuse_sidecar(src: ResolvedSource, given: str) -> None:
    """Refuse a source that is an mpack sidecar (it holds ``mpack.json``), not a checkpoint.

    A sidecar copies the checkpoint's ``config.json``, so without this check converting one by
    mistake fails much later, on its rank files ("tensor ... also appears in rank-00-...").

    Raises:
        InputError: naming the source the sidecar's manifest records, and what to do instead.
    """
    if not os.path.lexists(src.path / MANIFEST_NAME):
        return
    origin, original = recorded_origin(src.path)
    redo = f"mpack convert {original} -o OUT" if original else "mpack convert <checkpoint> -o OUT"
    here = src.path if src.kind == "hub" else given
    raise InputError(
        f"{given} is already an mpack sidecar (made from {origin}), not a checkpoint to convert",
        hint=f"convert the original checkpoint ({redo}), or use this sidecar as it is: "
        f"mpack serve {here}",
    )


def recorded_origin(sidecar: Path) -> tuple[str, str | None]:
    """What a sidecar's manifest says it was made from: ``(for people, as mpack convert
    arguments or None)``. Lenient: any readable ``mpack.json`` will do, whatever its version."""
    try:
        path = sidecar / MANIFEST_NAME
        doc = parse_json(read_capped(path, MAX_MANIFEST, what="manifest"), path)
        rec = doc.get("source") if isinstance(doc, dict) else None
    except MpackError:
        rec = None
    if not isinstance(rec, dict):
        return "a source its mpack.json does not record", None
    repo, rev, path = (rec.get(k) for k in ("repo", "revision", "path"))
    # Lenient, but what it returns goes into a message: quoted (Note [quoting untrusted text]).
    if rec.get("kind") == "hub" and isinstance(repo, str) and repo:
        if isinstance(rev, str) and rev:
            return f"{shown(repo)}@{shown(rev[:12])}", f"{shown(repo)} --revision {shown(rev[:64])}"
        return shown(repo), shown(repo)
    if isinstance(path, str) and path:
        if not os.path.isabs(path):  # its name only: where it is, this machine's cache may say
            kept = recalled_source_dir(rec, sidecar.resolve())  # (Note [source path])
            path = str(kept) if kept else path
        return shown(path, 4096), shown(path, 4096)
    return "a source its mpack.json does not record", None


def cached_source(repo: str, revision: str) -> ResolvedSource:
    """``repo`` at ``revision`` from the local Hugging Face cache only: never a network call
    (``local_files_only``), whatever ``HF_HUB_OFFLINE`` says.

    Raises:
        SourceNotFoundError: the snapshot is not in the cache, or only partly.
    """
    return _snapshot(repo, revision, False, local_only=True)


def _snapshot(
    repo: str, revision: str | None, show_progress: bool, *, local_only: bool = False
) -> ResolvedSource:
    from huggingface_hub import snapshot_download

    try:
        from mpack.hub import hub_progress  # the one owner of that switch

        with hub_progress(show_progress):
            path = Path(
                snapshot_download(
                    repo_id=repo,
                    revision=revision,
                    allow_patterns=NEEDED_PATTERNS,
                    local_files_only=local_only,
                )
            )
            commit = path.name if is_commit(path.name) else None
            _fetch_optional(snapshot_download, repo, commit or revision, local_only)
    except (*_hub_errors(), OSError) as e:  # network errors surface as requests/httpx OSErrors
        raise _snapshot_error(e, repo, revision, local_only) from None
    check_snapshot_links(path)
    return ResolvedSource(path=path, kind="hub", repo=repo, revision=commit, requested=revision)


# Note [optional files]: the licence files, llm-compressor's recipe and the model card make the
# pushed card right, but a conversion does not need them. huggingface_hub 2.x refuses an offline
# snapshot_download whose cached tree lists a file its patterns take that is not in the cache,
# and earlier mpacks (and many ``hf download --include`` commands) fetched none of these. So
# they are asked for in a second call, at the commit the first resolved, and any failure of it
# (offline and not cached, the Hub unreachable) leaves them out: the conversion goes on, and
# ``-v`` says why. What the snapshot then holds is what the conversion records and copies.
def _fetch_optional(
    snapshot_download: Any, repo: str, revision: str | None, local_only: bool
) -> None:
    """Fetch :data:`OPTIONAL_PATTERNS` of ``repo`` at ``revision`` into the cache where it can
    (Note [optional files])."""
    try:
        snapshot_download(
            repo_id=repo,
            revision=revision,
            allow_patterns=OPTIONAL_PATTERNS,
            local_files_only=local_only,
        )
    except Exception as e:  # noqa: BLE001 - optional: any failure only leaves them out
        log.debug(
            "%s: licence files and model card not fetched (%s: %s)", repo, type(e).__name__, e
        )


def check_snapshot_links(snapshot: Path) -> None:
    """Every file of the HF cache ``snapshot`` that a conversion may read (the top-level files
    of ``ALLOW_PATTERNS``, which it follows and copies) resolves into the repo's ``blobs/``
    (Note [links of the snapshot] in mpack/hub_sidecar.py).

    Raises:
        InputError: a link that points elsewhere (``/etc/passwd``, another repo's or user's file),
            naming it and its target.
    """
    from mpack.hub_sidecar import snapshot_blob

    for name in sorted(os.listdir(snapshot)):
        path = snapshot / name
        if not path.is_symlink() and path.is_dir():
            continue  # a folder of the repo ("tokenizer/"): nothing a conversion reads
        if any(fnmatch.fnmatchcase(name, p) for p in ALLOW_PATTERNS):
            snapshot_blob(path, snapshot)


def _hub_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub's errors that :func:`_snapshot_error` words, most particular first:
    incomplete snapshot (newer huggingface_hub only), gated repo, no repo, no revision, not in
    the cache."""
    from huggingface_hub import errors

    incomplete = getattr(errors, "IncompleteSnapshotError", None)  # else LocalEntryNotFoundError
    return (
        *((incomplete,) if incomplete is not None else ()),
        errors.GatedRepoError,
        errors.RepositoryNotFoundError,
        errors.RevisionNotFoundError,
        errors.LocalEntryNotFoundError,
    )


def _snapshot_error(
    e: BaseException, repo: str, revision: str | None, local_only: bool
) -> SourceNotFoundError:
    """What a failed download of ``repo`` at ``revision`` means, in mpack's words."""
    from huggingface_hub import errors

    rev = f"@{revision}" if revision else ""
    incomplete = getattr(errors, "IncompleteSnapshotError", ())
    if isinstance(e, incomplete):
        return SourceNotFoundError(
            f"{repo}{rev}: the cached snapshot is incomplete ({e})",
            hint=(
                "download it again with network access (unset HF_HUB_OFFLINE), "
                "or pass a local directory"
            ),
        )
    if isinstance(e, errors.GatedRepoError):
        return SourceNotFoundError(
            f"{repo}: the repo is gated",
            hint="accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)",
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return SourceNotFoundError(
            f"{repo}: no such repo on the Hub (or it is private)",
            hint="check the id, or log in with `hf auth login`",
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return SourceNotFoundError(
            f"{repo}{rev}: no such revision", hint="give a branch, tag or commit sha"
        )
    if isinstance(e, errors.LocalEntryNotFoundError) and local_only:
        return SourceNotFoundError(
            f"{repo}{rev}: not in the local Hugging Face cache",
            hint=f"download it with network access (hf download {repo}"
            f"{f' --revision {revision}' if revision else ''}), or pass a local directory",
        )
    if isinstance(e, errors.LocalEntryNotFoundError):
        return SourceNotFoundError(
            f"{repo}{rev}: not in the local Hugging Face cache and the Hub cannot be reached",
            hint=(
                "download it once with network access (unset HF_HUB_OFFLINE), "
                "or pass a local directory"
            ),
        )
    return SourceNotFoundError(f"{repo}{rev}: cannot download ({e})")


def source_files(src: ResolvedSource, shards: list[str]) -> list[str]:
    """The files a conversion uses: the shards, the index, the copied files, and the model card
    whose licence metadata the manifest records (:func:`card_facts`)."""
    names = set(shards)
    for extra in (INDEX_NAME, *COPIED_FILES, SOURCE_CARD_NAME):
        if (src.path / extra).is_file():
            names.add(extra)
    return sorted(names)


def hash_workers() -> int:
    """Threads for source hashing: enough to outrun one disk, few enough to leave the pipeline
    its cores (it reads, transforms, writes and hashes its output at the same time)."""
    return max(2, min(8, usable_cores() // 2))


# Note [source digests]: a record is ``{name, size, sha256}`` for an LFS blob of the HF cache
# (named by its sha256: nothing is read) and for a file of at most one chunk, else
# ``{name, size, chunks}`` with the digest of every ``CHUNK_BYTES`` piece. One sha256 stream over
# a shard of several GB would outlast the conversion it describes (figures: docs/BENCHMARKS.md,
# sections 2 and 9); the chunks of all files are hashed on ``workers`` threads at once.
def hash_sources(
    src: ResolvedSource,
    names: list[str],
    *,
    stop: threading.Event | None = None,
    timeline: Timeline | None = None,
    forms: dict[str, str] | None = None,
    workers: int | None = None,
) -> list[dict[str, Any]]:
    """The manifest record of every source file, in name order (``stop`` aborts it):
    ``{name, size, sha256}`` or ``{name, size, chunks}`` (Note [source digests]), the chunks
    hashed on ``workers`` threads. ``forms`` (name -> ``"sha256"`` or ``"chunks"``) asks for a
    recorded form instead, to compare with a manifest written otherwise.
    """
    forms = forms or {}
    records: dict[str, dict[str, Any]] = {}
    jobs: list[tuple[str, int, int]] = []  # (name, start, end) of every chunk to hash
    for name in names:
        p = src.path / name
        size = p.stat().st_size
        records[name] = {"name": name, "size": size}
        lfs = _lfs_sha256(p)
        form = forms.get(name) or ("sha256" if lfs or size <= CHUNK_BYTES else "chunks")
        if form == "sha256" and lfs:
            records[name]["sha256"] = lfs
        elif form == "sha256" or size == 0:
            jobs.append((name, 0, -1))  # -1: the whole file, one stream
        else:
            jobs += [(name, a, b) for a, b in chunk_spans(size, CHUNK_BYTES)]

    def run(job: tuple[str, int, int]) -> str:
        if stop is not None and stop.is_set():
            raise HashCancelled(job[0])
        with timeline.span("hash-src", job[0]) if timeline else contextlib.nullcontext():
            if job[2] < 0:
                return sha256_file(src.path / job[0], stop=stop)
            return hash_range(src.path / job[0], job[1], job[2])

    with pool("hash", workers or hash_workers()) as p:
        digests = list(p.map(run, jobs))
    for (name, _, end), digest in zip(jobs, digests, strict=True):
        rec = records[name]
        if end < 0:
            rec["sha256"] = digest
        else:
            rec.setdefault("chunks", {"bytes": CHUNK_BYTES, "sha256": []})["sha256"].append(digest)
    for name in filter(is_shard, names):  # Note [a sidecar is bound to its checkpoint]
        records[name][PROBE_KEY] = probe(src.path / name)
    return [records[n] for n in names]


@contextlib.contextmanager
def hashing(
    src: ResolvedSource,
    names: list[str],
    *,
    forms: dict[str, str] | None = None,
    timeline: Timeline | None = None,
) -> Iterator[Future[list[dict[str, Any]]]]:
    """:func:`hash_sources` of ``names`` on a thread of its own, started now (the reads also
    warm the page cache for a conversion's or a verification's own); stopped if the block ends
    before it is done."""
    stop = threading.Event()
    with pool("hash", 1) as p:
        try:
            yield p.submit(hash_sources, src, names, forms=forms, stop=stop, timeline=timeline)
        finally:
            stop.set()  # a no-op once the hashes are in


def record_forms(records: list[dict[str, Any]]) -> dict[str, str]:
    """name -> ``"sha256"`` or ``"chunks"``: how each file is recorded (for
    :func:`hash_sources`)."""
    return {
        r.get("name"): "chunks" if "chunks" in r else "sha256"
        for r in records
        if isinstance(r, dict)
    }


def _lfs_sha256(p: Path) -> str | None:
    """The sha256 an HF-cache LFS blob is named by (``p`` links to ``blobs/<sha256>``), or None."""
    if p.is_symlink():
        blob = Path(os.path.realpath(p))
        if _SHA256.match(blob.name) and blob.parent.name == "blobs":
            return blob.name
    return None


def candidate_files(src: ResolvedSource) -> list[str]:
    """What :func:`source_files` will most likely return, known before any header is parsed:
    lets hashing (and with it the page cache) start while the checkpoint is still validated."""
    shards = [p.name for p in src.path.glob("*.safetensors")]
    return source_files(src, shards)


def provenance(src: ResolvedSource, files: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's ``source`` object. A local source is recorded by its directory's name
    (``ckpt``), not by where it is, which ``mpack push`` would publish (Note [source path] in
    :mod:`mpack.cache`); ``MPACK_SOURCE_PATH=full`` records its absolute path instead."""
    doc: dict[str, Any] = {"kind": src.kind, "files": files}
    if src.kind == "hub":
        doc.update(repo=src.repo, revision=src.revision, requested_revision=src.requested)
    elif os.environ.get("MPACK_SOURCE_PATH") == "full" or not src.path.name:
        doc.update(path=str(src.path))
    else:
        doc.update(path=src.path.name)
    return doc | card_facts(src)


# Note [card facts]: what the card of a pushed sidecar says about its source and cannot learn at
# push time, when the source may be gone: the Hub repo a local directory is a snapshot of (an HF
# cache folder ``.../models--org--name/snapshots/<commit>``, as ``hf download`` without
# ``--local-dir`` leaves it), and the source card's licence metadata. They are recorded in the
# manifest's ``source`` (``mpack.sidecar.SOURCE_CARD_KEYS``) only when found, and only values the
# Hub's card metadata takes as they are: a licence id or name of the Hub's characters, and a link
# that is a URL or a plain file name of the source (docs/HUB.md, "The model card").

#: The most bytes of the source's README.md read for its metadata.
SOURCE_CARD_MAX = 1 << 20


def card_facts(src: ResolvedSource) -> dict[str, str]:
    """The optional ``source`` keys of Note [card facts] for ``src``: ``base_model`` (a local
    HF-cache snapshot's repo id) and ``license``, ``license_name``, ``license_link`` from the
    front matter of its ``README.md``. Lenient: a card that cannot be read or parsed, or a value
    of another form, records nothing."""
    facts: dict[str, str] = {}
    if src.kind == "local":
        repo = snapshot_repo(src.path)
        if repo is not None:
            facts["base_model"] = repo
    card = src.path / SOURCE_CARD_NAME
    if not card.is_file():
        return facts
    try:
        text = read_capped(card, SOURCE_CARD_MAX, what="model card", follow=True).decode()
        from huggingface_hub import ModelCard  # the Hub's own parser of card metadata

        data = ModelCard(text, ignore_metadata_errors=True).data
    except Exception as e:  # noqa: BLE001 - any card we cannot read only loses its licence
        log.debug(
            "the source's %s gave no metadata (%s: %s)", SOURCE_CARD_NAME, type(e).__name__, e
        )
        return facts
    for key in ("license", "license_name", "license_link"):
        value = getattr(data, key, None)
        if is_card_fact(key, value):
            facts[key] = value
    return facts


def snapshot_repo(path: Path) -> str | None:
    """The repo id of an HF-cache snapshot directory ``.../models--org--name/snapshots/<commit>``
    (``org/name``), or None for any other directory."""
    snap = path.parent
    repo_dir = snap.parent.name
    if snap.name != "snapshots" or not is_commit(path.name) or not repo_dir.startswith("models--"):
        return None
    repo = repo_dir.removeprefix("models--").replace("--", "/")  # a repo id has no "--"
    return repo if is_card_fact("base_model", repo) else None


# --- a source that must not change under the run -----------------------------------------

#: ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of a source file, symlinks followed.
Stamp = tuple[int, int, int, int, int]


class SourceChangedError(InputError):
    """A source file was replaced, modified, removed or added while a conversion read it."""


# Note [stable source]: a conversion reads a shard several times (headers, scales, tensor
# data, the digests of the manifest), by name. If the file behind a name changes in between
# (``mv new.safetensors SRC/model-00003-of-00004.safetensors``, a download still running, an
# edit in place), the manifest would record digests of bytes that were not converted. So
# every file the run may read (the top-level files of ``ALLOW_PATTERNS``; symlinks followed,
# as the HF cache links into ``blobs/``) is stamped before anything is read, and stamped
# again at the end, before the manifest is written: any difference fails the run
# (:func:`check_sources_unchanged`). A replaced file has another inode, a file written in
# place another size, mtime or ctime (a rename changes the ctime too, so even a file swapped
# away and back is seen); a file removed or added changes the set of names.
def stamp_sources(src: ResolvedSource) -> dict[str, Stamp]:
    """The identity, size and times of every file a conversion may read from ``src`` (the
    top-level files of ``ALLOW_PATTERNS``, symlinks followed), to compare at the end of the run
    with :func:`check_sources_unchanged` (Note [stable source])."""
    stamps: dict[str, Stamp] = {}
    try:
        entries = sorted(os.listdir(src.path))
    except FileNotFoundError:
        return stamps  # the directory is gone: every file disappeared
    except OSError as e:
        if e.errno in ENVIRONMENT_ERRNOS:
            raise environment_failure(e) from None
        raise
    for name in entries:
        if not any(fnmatch.fnmatchcase(name, p) for p in ALLOW_PATTERNS):
            continue
        try:
            st = os.stat(src.path / name)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP):
                continue  # a dangling link: not a file the run can read
            if e.errno in ENVIRONMENT_ERRNOS:
                raise environment_failure(e) from None
            raise
        if stat.S_ISREG(st.st_mode):
            stamps[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return stamps


def source_changes(src: ResolvedSource, before: dict[str, Stamp]) -> SourceChangedError | None:
    """The error describing how ``src`` changed since ``before`` (:func:`stamp_sources`), or
    None when every file is as it was."""
    after = stamp_sources(src)
    changes = []
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a == b:
            continue
        if b is None:
            what = "disappeared"
        elif a is None:
            what = "appeared"
        elif a[:2] != b[:2]:
            what = "was replaced by another file"
        elif a[2] != b[2]:
            what = f"changed size from {a[2]} to {b[2]} bytes"
        else:
            what = "was modified in place (its mtime or ctime changed)"
        changes.append(f"{src.path / name} {what}")
    if not changes:
        return None
    more = f" (and {len(changes) - 1} more file(s) changed)" if len(changes) > 1 else ""
    return SourceChangedError(
        f"the source checkpoint changed while mpack was converting it: {changes[0]}{more}; "
        "nothing was written",
        hint="rerun once the source is stable (no download, copy or edit in progress)",
    )


def check_sources_unchanged(src: ResolvedSource, before: dict[str, Stamp]) -> None:
    """Raise :class:`SourceChangedError` if ``src`` changed since ``before``."""
    changed = source_changes(src, before)
    if changed is not None:
        raise changed

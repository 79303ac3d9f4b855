"""Loading a sidecar by Hub repo id: ``org/name[/<target>][@revision]`` to a local directory.

Every command and function that takes a sidecar directory also takes a repo id (docs/HUB.md,
"Loading by repo id"): ``mpack inspect``, ``verify``, ``serve``, ``status``,
``mpack.runtime.attach`` / ``load`` and the vLLM loader all call :func:`resolve_sidecar` first.

The rules:

* A local path that exists wins. So does anything that is not a repo id (``./x``, ``/x``,
  a bare name): it is returned as it is, and the reader says what is wrong with it.
* ``org/name`` is a single-target repo (the sidecar at the root); ``org/name/<target>`` names
  the folder of one target of a multi-target repo (``mpack push``'s layout: a repo id has
  exactly one slash, so a third component is a folder). ``@revision`` (or ``revision=``) picks
  a branch, tag or commit.
* Files come through huggingface_hub's ``hf_hub_download``, so the HF cache (``HF_HOME``,
  ``HF_HUB_CACHE``), ``HF_HUB_OFFLINE``, ``HF_TOKEN`` and ``HF_ENDPOINT`` hold as they do for
  any download. ``mpack.json`` comes first; then only what the caller needs (Note [what a
  resolve fetches]), every file from the commit the manifest came from.

Note [a view of the snapshot]: the HF cache's snapshot folders are made of symbolic links into
``blobs/``, and a sidecar reader opens no symbolic link (Note [trust model for files] in
mpack/fsutil.py). So the files a resolve fetched are hard-linked into a directory of regular
files, ``<repo's cache folder>/mpack/<commit>[/<target>]``, next to ``snapshots/`` (the same
file system as the blobs, so a link, never a copy, where the file system has hard links; a
copy where it has none). That directory is the path returned. Each name is linked under a
temporary name and renamed into place, so TP ranks resolving the same repo at once never see a
partial file. huggingface_hub's cache scan looks only at ``blobs``, ``refs`` and
``snapshots``; deleting the repo from the cache deletes the view with it. The bytes are checked
as from any sidecar: the manifest by the strict reader, every other file against the manifest's
digests as it is read.

A local directory is always used as it is, never looked up on the Hub, wherever it lies and
whatever its path looks like. One that is a snapshot of an HF cache, its ``mpack.json`` a symbolic
link (vLLM replaces a repo id with one under ``HF_HUB_OFFLINE=1``; ``--download-dir`` puts it in
a cache of its own), is made into the same view from its own files, in its own cache folder.

Note [links of the snapshot]: a snapshot's file is a link to ``../../blobs/<id>`` in a cache
huggingface_hub wrote; a cache anyone else could write (or a crafted one) may hold a link to
``/etc/passwd`` or another user's file, which a view would then hard-link and a conversion copy
into its sidecar. So every file taken from a snapshot, here and by ``mpack convert`` reading a
Hub source (:func:`snapshot_blob`), must resolve to a file in its repo's ``blobs/`` folder
(or be a regular file of the snapshot itself, as a cache without symbolic links holds them);
anything else is refused, naming the link and where it points.

This module is core (docs/ARCHITECTURE.md); huggingface_hub is imported only once a repo id
must be fetched.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpack.errors import (
    EnvironmentFailure,
    InputError,
    SourceNotFoundError,
    UsageError,
    arg,
    environment_failure,
    quote,
    shown,
)
from mpack.sidecar import MANIFEST_NAME, is_commit, load_manifest, rank_file_name
from mpack.target import dir_name
from mpack.target_dirs import Selection, choose, find, is_sidecar

#: The folder next to ``snapshots/`` that holds the views (Note [a view of the snapshot]).
VIEW_DIR = "mpack"
#: Which files a resolve fetches (Note [what a resolve fetches]).
FETCH = ("manifest", "rank", "all")
_FOLDER = re.compile(r"[A-Za-z0-9][\w.-]*")

# Note [what a resolve fetches]: ``fetch="manifest"``: ``mpack.json`` alone (inspect, status
# and attach read nothing else; a daemon is found by the manifest's digest). ``"rank"``: the
# files one TP rank loads, its ``rank-XX-of-YY.safetensors``, ``common.safetensors`` and the
# small copied files (config, tokenizer), not the other ranks' files. ``"all"``: every listed
# file (verify checks them all; ``rank=None`` with ``"rank"`` means the same).


@dataclass(frozen=True)
class HubRef:
    """A sidecar on the Hub: ``repo`` (``org/name``), the ``folder`` of one target in a
    multi-target repo (None: the root) and the ``revision`` asked for (None: main)."""

    repo: str
    folder: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        name = f"{self.repo}/{self.folder}" if self.folder else self.repo
        return f"{name}@{self.revision}" if self.revision else name


def parse_ref(ref: str, revision: str | None = None) -> HubRef | None:
    """``org/name[/<target>][@rev]`` as a :class:`HubRef`; None when ``ref`` is not one (a path
    such as ``./x``, ``/x``, ``~/x``, or a bare name).

    Raises:
        UsageError: a revision both in ``ref`` (``@rev``) and in ``revision``, or an empty one.
    """
    if not ref or ref.startswith((".", "/", "~")) or "\\" in ref or "\0" in ref:
        return None
    name, at, rev = ref.partition("@")
    if at and not rev:
        raise UsageError(f"{quote(ref)}: nothing after '@'", hint="give a branch, tag or commit")
    if at and revision and rev != revision:
        raise UsageError(
            f"{quote(ref)} names revision {quote(rev)}, and --revision says {quote(revision)}",
            hint="give the revision once",
        )
    parts = name.split("/")
    if len(parts) not in (2, 3):
        return None
    repo = "/".join(parts[:2])
    folder = parts[2] if len(parts) == 3 else None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    if folder is not None and (not _FOLDER.fullmatch(folder) or ".." in folder):
        return None
    return HubRef(repo, folder, rev or revision or None)


def resolve_sidecar(
    ref: str | os.PathLike,
    revision: str | None = None,
    *,
    rank: int | None = None,
    fetch: str = "rank",
    target: Mapping[str, Any] | None = None,
    select: Selection | None = None,
) -> Path:
    """The local sidecar directory of ``ref``: a path, or a Hub repo id (module docstring).

    ``rank`` and ``fetch`` say which files to fetch (Note [what a resolve fetches]).
    ``target``: a manifest-style target (``tp_size``, ``profile``, ``act_dtype``, ``fusion``)
    used where ``ref`` is a multi-target repo (or its snapshot) given without a folder: the
    folder of that target is taken (the vLLM loader passes the engine's). Else a local
    directory of targets gives its one target that ``select`` names (``--tp``, ``--profile``
    ...; any, where it holds one), and a repo of several the folder ``select`` names whole
    (:func:`mpack.target_dirs.choose`, Note [target layout]); a sidecar that is not the one
    ``select`` names is refused.

    Raises:
        UsageError: ``revision`` given with a local path, or twice; a directory of several
            targets and no ``select`` that names one of them (they are listed), or a sidecar
            of another target than ``select`` names.
        SourceNotFoundError: no such repo, revision or file, or (offline) not in the HF cache.
        InputError: the repo (or folder) holds no ``mpack.json``: not a sidecar; or a file of
            its snapshot links outside the repo's ``blobs/`` (Note [links of the snapshot]).
        EnvironmentFailure: the Hub cannot be reached, refused the token, or the cache cannot
            be written (exit 3).
    """
    if fetch not in FETCH:
        raise ValueError(f"fetch must be one of {FETCH}, got {fetch!r}")
    p = Path(ref).expanduser()
    if os.path.lexists(p):
        if revision:
            raise UsageError(
                f"--revision {quote(revision)} applies to Hub repo ids, but {p} is a local path"
            )
        local = _local_target(p, target, select or Selection())
        snap = _snapshot_of(local)
        return local if snap is None else _local_view(local, *snap, rank, fetch)
    hub = parse_ref(os.fspath(ref), revision)
    if hub is None:
        return p  # not a repo id: the reader says "no such directory"
    try:
        return _fetch(hub, rank, fetch, target, select or Selection())
    except (SourceNotFoundError, EnvironmentFailure) as e:
        # perhaps a mistyped directory, not a repo: say both (an existing one never gets here)
        e.message = f"{e.message} (and there is no local directory {p})"
        e.args = (e.message,)
        raise


def _local_target(p: Path, target: Mapping[str, Any] | None, select: Selection) -> Path:
    """``p``, or its folder of ``target`` when ``p`` is a directory of sidecars (a multi-target
    ``mpack convert`` output, or a repo's root) without its own manifest; without ``target``,
    the one sidecar of ``p`` that ``select`` names (:func:`mpack.target_dirs.choose`)."""
    if target is not None:
        return p if is_sidecar(p) else (find(p, target) or p)
    if not select and is_sidecar(p):
        return p  # the reader checks it; nothing to choose
    return choose(p, select)


def _snapshot_of(p: Path) -> tuple[Path, str | None] | None:
    """``(commit folder, target folder or None)`` of ``p`` where it is a snapshot of an HF cache
    (``.../snapshots/<commit>[/<folder>]``) whose ``mpack.json`` is a symbolic link, as
    huggingface_hub leaves it; else None: ``p`` is read as it is (a sidecar copied to a path
    of that shape holds regular files)."""
    if not os.path.islink(p / MANIFEST_NAME):
        return None
    try:
        d = p.resolve(strict=True)
    except OSError:
        return None
    for snap, folder in ((d, None), (d.parent, d.name)):  # the commit's folder, or a target's
        if snap.parent.name == "snapshots" and is_commit(snap.name):
            return snap, folder
    return None


def _local_view(
    p: Path, commit_dir: Path, folder: str | None, rank: int | None, fetch: str
) -> Path:
    """The view (Note [a view of the snapshot]) of the local snapshot ``p``, from its own files:
    no Hub, no download; a file it lacks is named."""
    snap = commit_dir / folder if folder else commit_dir
    view = commit_dir.parent.parent / VIEW_DIR / commit_dir.name
    if folder:
        view = view / folder
    _make_dir(view)
    _link(snap / MANIFEST_NAME, view / MANIFEST_NAME, commit_dir)
    if fetch == "manifest":
        return view
    manifest, _ = load_manifest(view)  # the strict reader: names are plain, counts bounded
    for name in needed_files(manifest, None if fetch == "all" else rank):
        if os.path.lexists(view / name):
            continue
        if not os.path.lexists(snap / name):
            raise SourceNotFoundError(
                f"{p}: {name} is listed in its {MANIFEST_NAME} but is not in this snapshot of the "
                "Hugging Face cache",
                hint="fetch it by the repo id (e.g. mpack verify org/name), which downloads what "
                "the snapshot lacks, or pass a sidecar directory that holds every file",
            )
        _link(snap / name, view / name, commit_dir)
    return view


def target_folder(target: Mapping[str, Any]) -> str:
    """The repo folder of a target (``mpack.hub.target_dir_name``'s rule)."""
    return dir_name(target)


# --- fetching ---------------------------------------------------------------------------------


def _fetch(
    hub: HubRef,
    rank: int | None,
    fetch: str,
    target: Mapping[str, Any] | None,
    select: Selection,
) -> Path:
    try:
        snap_manifest = _download(hub, MANIFEST_NAME)
    except _NoManifest as e:
        want = target if target is not None else select.exact()
        if hub.folder is not None or want is None:
            if select and hub.folder is None:  # a selection that names no folder whole
                e.error.hint = (
                    f"name the target's folder, {hub.repo}/<target>, or give {arg('tp')}, "
                    f"{arg('profile')} and {arg('act_dtype')} together (the repo's model card "
                    "lists its targets)"
                )
            raise e.error from None
        hub = HubRef(hub.repo, target_folder(want), hub.revision)
        by = "the engine's target" if target is not None else f"the target {select.words()} names"
        snap_manifest = _download(hub, MANIFEST_NAME, picked=by)
    commit_dir = snap_manifest.parent if hub.folder is None else snap_manifest.parent.parent
    commit = commit_dir.name
    repo_cache = commit_dir.parent.parent
    view = repo_cache / VIEW_DIR / commit
    if hub.folder:
        view = view / hub.folder
    _make_dir(view)
    _link(snap_manifest, view / MANIFEST_NAME, commit_dir)
    if select:
        choose(view, select)  # a sidecar of another target than the one named: refused
    if fetch == "manifest":
        return view
    manifest, _ = load_manifest(view)  # the strict reader: names are plain, counts bounded
    pinned = HubRef(hub.repo, hub.folder, commit)  # every file from the manifest's commit
    for name in needed_files(manifest, None if fetch == "all" else rank):
        if not os.path.lexists(view / name):
            _link(_download(pinned, name), view / name, commit_dir)
    return view


def needed_files(manifest: Mapping[str, Any], rank: int | None) -> list[str]:
    """The listed files of a sidecar that ``rank`` loads (every one for None): its rank file,
    ``common.safetensors`` and the copied files; not the other ranks' rank files."""
    names = [f["name"] for f in manifest["files"]]
    if rank is None:
        return names
    tp = manifest["target"]["tp_size"]
    others = {rank_file_name(r, tp) for r in range(tp) if r != rank}
    return [n for n in names if n not in others]


class _NoManifest(Exception):
    """The repo (at this revision) exists, or may, but has no ``mpack.json`` where we looked."""

    def __init__(self, error: InputError) -> None:
        self.error = error


def _download(hub: HubRef, name: str, *, picked: str | None = None) -> Path:
    """One file of ``hub`` through the HF cache; its path in the snapshot."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    path_in_repo = f"{hub.folder}/{name}" if hub.folder else name
    rev = f"@{hub.revision}" if hub.revision else ""
    try:
        return Path(hf_hub_download(hub.repo, path_in_repo, revision=hub.revision))
    except LocalEntryNotFoundError:
        # Offline (or the Hub unreachable) and not in the cache. Is the snapshot there at all?
        cached = try_to_load_from_cache(hub.repo, "config.json", revision=hub.revision)
        if name == MANIFEST_NAME and isinstance(cached, str):
            raise _NoManifest(_not_a_sidecar(hub, picked, "its cached snapshot")) from None
        raise SourceNotFoundError(
            f"{hub.repo}{rev}: {path_in_repo} is not in the local Hugging Face cache, and the "
            "Hub cannot be reached (HF_HUB_OFFLINE, or no network)",
            hint=f"download it once with network access (hf download {hub.repo}"
            f"{f' --revision {hub.revision}' if hub.revision else ''}), unset HF_HUB_OFFLINE, "
            "or pass a local sidecar directory",
        ) from None
    except GatedRepoError:
        raise SourceNotFoundError(
            f"{hub.repo}: the repo is gated",
            hint="accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)",
        ) from None
    except RepositoryNotFoundError:
        raise SourceNotFoundError(
            f"{hub.repo}: no such repo on the Hub (or it is private)",
            hint="check the id, or log in (`hf auth login` or HF_TOKEN)",
        ) from None
    except RevisionNotFoundError:
        raise SourceNotFoundError(
            f"{hub.repo}{rev}: no such revision", hint="give a branch, tag or commit sha"
        ) from None
    except EntryNotFoundError:
        if name == MANIFEST_NAME:
            raise _NoManifest(_not_a_sidecar(hub, picked, "the repo")) from None
        raise SourceNotFoundError(
            f"{hub.repo}{rev}: {path_in_repo} is listed in the sidecar's {MANIFEST_NAME} but "
            "is not in the repo",
            hint="push the whole sidecar again (mpack push SIDECAR REPO_ID)",
        ) from None
    except HfHubHTTPError as e:
        raise _hub_error(hub, f"the Hub refused the download ({e})") from None
    except OSError as e:  # no network: requests/httpx errors are OSErrors
        if e.errno in (errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise environment_failure(e, "writing the Hugging Face cache") from None
        raise _hub_error(hub, f"cannot download ({e})") from None


def _not_a_sidecar(hub: HubRef, picked: str | None, where: str) -> InputError:
    if picked:
        return InputError(
            f"{hub.repo}: no {MANIFEST_NAME} at the root of {where}, nor in folder "
            f"{hub.folder} ({picked})",
            hint=f"name the target's folder: {hub.repo}/<target> (the repo's model card lists "
            "them), or convert and push this target",
        )
    at = f" in folder {hub.folder}" if hub.folder else " at its root"
    return InputError(
        f"{hub}: {where} has no {MANIFEST_NAME}{at}: not an mpack sidecar",
        hint=f"for a repo of several targets, name the target's folder: {hub.repo}/<target>, "
        "e.g. tp2-w8a16-bfloat16 (the repo's model card lists them)",
    )


def _hub_error(hub: HubRef, what: str) -> EnvironmentFailure:
    return EnvironmentFailure(
        f"{hub}: {what}",
        hint="check the network and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the local cache",
    )


# --- the view (Note [a view of the snapshot]) ------------------------------------------------


def _make_dir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o755)
    except OSError as e:
        raise environment_failure(e, "making mpack's view of the Hugging Face cache") from None


def snapshot_blob(link: Path, commit_dir: Path) -> Path:
    """The file behind ``link``, a file of the HF cache snapshot ``commit_dir``
    (``<repo>/snapshots/<commit>``), symbolic links resolved: a regular file in the repo's
    ``blobs/`` folder, or in the snapshot itself (Note [links of the snapshot]).

    Raises:
        InputError: it resolves anywhere else, or to no regular file (naming the link and where
            it points).
        EnvironmentFailure: it cannot be read (permission denied and the like).
    """
    target = Path(os.path.realpath(link))
    blobs = Path(os.path.realpath(commit_dir.parent.parent / "blobs"))
    inside = target.parent == blobs or Path(os.path.realpath(commit_dir)) in target.parents
    if not inside:
        raise InputError(
            f"{link}: a link in the Hugging Face cache to {shown(os.fspath(target), 300)}, which "
            f"is not in the repo's blobs folder {blobs}: refusing to follow it",
            hint=f"the cache was changed after huggingface_hub wrote it: remove "
            f"{commit_dir.parent.parent} and download the repo again, or pass a local directory",
        )
    try:
        if not stat.S_ISREG(os.stat(target).st_mode):
            raise InputError(f"{link}: not a regular file in the Hugging Face cache")
    except FileNotFoundError:
        raise SourceNotFoundError(
            f"{link}: a link in the Hugging Face cache to a missing file"
        ) from None
    except OSError as e:
        raise environment_failure(e, "reading the Hugging Face cache") from None
    return target


def _link(src: Path, dst: Path, commit_dir: Path) -> None:
    """``dst``: a hard link to the regular file behind ``src`` (a link of the snapshot
    ``commit_dir`` to a blob: :func:`snapshot_blob`), or a copy where the file system has no
    hard links; written under a temporary name and renamed into place. An existing regular
    ``dst`` is kept: a view holds one commit."""
    try:
        st = os.lstat(dst)
        if stat.S_ISREG(st.st_mode):
            return
    except FileNotFoundError:
        pass
    except OSError as e:
        raise environment_failure(e, "reading mpack's view of the Hugging Face cache") from None
    blob = snapshot_blob(src, commit_dir)
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(6)}.tmp"
    try:
        try:
            os.link(blob, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(blob, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        raise environment_failure(e, "linking a file into mpack's view of the HF cache") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


__all__ = [
    "FETCH",
    "HubRef",
    "needed_files",
    "parse_ref",
    "resolve_sidecar",
    "snapshot_blob",
    "target_folder",
]

"""The output directory of ``convert``: where it is, who writes it, what it holds, and the swap.

A run checks ``-o`` before any work (:func:`output_path`, :func:`check_apart`), holds its lock
(:func:`output_lock`) from before it reads the source until OUT is in place, and writes the
sidecar through :func:`staged_sidecar`: OUT found up to date (:func:`existing_state`), or a
hidden work directory filled and swapped into place at the end (:func:`_swap_into_place`).

Note [atomic output]: nothing named OUT exists until the final rename; a killed run leaves only
a work directory ``.mpack-<key>.tmp-<rand>`` behind (no manifest at OUT), which the next run
removes. ``<key>``: 12 hex digits of the sha256 of OUT's name, so every hidden name has a fixed
length (an OUT name of 255 bytes still fits) and belongs to one OUT.

Note [output lock]: a run holds ``.mpack-<key>.lock`` (an ``flock``, :class:`mpack.fsutil.LockFile`)
in OUT's parent from before it reads the source until OUT is in place; a second run for the
same OUT stops at once with ``BusyError``. The kernel drops the lock when its holder dies,
whatever its pid namespace, so a work or old directory of this OUT found while we hold the lock
belongs to no live run: it is removed (those named the old way, ``.<OUT>.mpack-tmp-<pid>-<rand>``
and ``.<OUT>.mpack-old-<pid>-<rand>``, too). Pids play no part in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpack.convert.source import ResolvedSource, provenance, record_forms
from mpack.convert.timeline import Timeline
from mpack.errors import (
    BusyError,
    EnvironmentFailure,
    InputError,
    OutputExistsError,
    SourceNotFoundError,
    UsageError,
)
from mpack.fsutil import LockFile, LockHeld, os_error
from mpack.sidecar import COMMON_NAME, MANIFEST_NAME, fsync_dir, load_manifest, write_manifest

#: ``files(forms=None)``: the source's file records (:func:`existing_state`)
SourceRecords = Callable[..., list[dict[str, Any]]]


# --- where OUT is -----------------------------------------------------------------------------


def output_path(out: str | os.PathLike) -> Path:
    """The directory ``-o out`` names, made absolute and checked before any work.

    Note [output path]: ``out`` is resolved through symbolic links (``os.path.realpath``) and
    the sidecar is written at the target: ``-o link`` where ``link -> some/dir`` fills
    ``some/dir`` and keeps the link, so the link never turns into a directory and two runs
    through different links to one directory share one lock.

    Raises:
        UsageError: ``out`` is empty, the current directory or one of its ancestors (the run
            would replace it), a mount point (it cannot be renamed into place), or a symbolic
            link that does not resolve (a loop).
    """
    raw = os.fspath(out)
    if not raw:
        raise UsageError("-o is empty", hint="name a new directory, e.g. -o ./sidecar")
    p = Path(os.path.realpath(Path(raw).expanduser()))
    if p.is_symlink():
        raise UsageError(f"-o {raw}: a symbolic link that does not resolve (a loop?)")
    try:
        cwd = Path(os.path.realpath(os.getcwd()))
    except FileNotFoundError:  # the current directory was removed: -o is absolute, or fails later
        cwd = None
    if cwd is not None and (p == cwd or p in cwd.parents):
        what = "is the current directory" if p == cwd else "contains the current directory"
        raise UsageError(
            f"-o {raw} ({p}) {what}; the sidecar would replace it",
            hint="name a new directory, e.g. -o ./sidecar",
        )
    if os.path.ismount(p):
        raise UsageError(
            f"-o {raw} ({p}) is a mount point, which a finished sidecar cannot be renamed onto",
            hint=f"use a subdirectory of it, e.g. -o {p / 'sidecar'}",
        )
    return p


def check_apart(out: Path, source: Path) -> None:
    """Refuse an output inside the source, or a source inside the output (both resolved)."""
    src = Path(os.path.realpath(source))
    if out == src or src in out.parents:
        raise UsageError(
            f"-o {out} lies inside the source checkpoint {src}; choose another output directory"
        )
    if out in src.parents:
        raise UsageError(
            f"the source checkpoint {src} lies inside -o {out}, which the sidecar would replace",
            hint="choose an output directory outside the checkpoint",
        )


# --- the lock, and what dead runs left --------------------------------------------------------


def _key(out: Path) -> str:
    """12 hex digits naming ``out``'s lock and work directories (Note [atomic output])."""
    return hashlib.sha256(os.fsencode(out.name)).hexdigest()[:12]


def lock_path(out: Path) -> Path:
    """The lock file of a run writing ``out`` (Note [output lock])."""
    return out.parent / f".mpack-{_key(out)}.lock"


def _work_path(out: Path, kind: str) -> Path:
    """A new work (``tmp``) or old-sidecar (``old``) directory name for ``out``."""
    return out.parent / f".mpack-{_key(out)}.{kind}-{uuid.uuid4().hex[:8]}"


def work_dirs(out: Path) -> list[Path]:
    """Work and old-sidecar directories of runs for ``out``, new and old naming, sorted."""
    if not out.parent.is_dir():
        return []
    ours = re.compile(
        rf"\.mpack-{_key(out)}\.(tmp|old)-[0-9a-f]{{8}}"  # this mpack's names
        rf"|\.{re.escape(out.name)}\.mpack-(tmp|old)-\d+-[0-9a-f]{{8}}"  # older mpacks'
    )
    return sorted(out.parent / n for n in os.listdir(out.parent) if ours.fullmatch(n))


def clean_stale(out: Path) -> None:
    """Remove every work and old-sidecar directory of ``out``; call with ``out``'s lock held,
    when none of them can belong to a live run (Note [output lock])."""
    for p in work_dirs(out):
        _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock (Note [output lock]), creating ``out``'s parent directories as needed;
    those it created are removed again if they are empty at the end (a refused run leaves
    nothing). Where this process cannot write ``out``'s parent (a read-only mount of sidecars),
    no lock is taken: the run can then only find ``out`` up to date, or fail when it writes.

    Raises:
        BusyError: another run holds the lock.
        InputError, EnvironmentFailure: the parent cannot be created, or the lock file is not
            one we can trust (:class:`mpack.fsutil.LockFile`).
    """
    with contextlib.ExitStack() as stack:
        made = _make_dirs(out.parent)
        stack.callback(_remove_empty, made)
        if not os.access(out.parent, os.W_OK):
            yield
            return
        try:
            stack.enter_context(LockFile(lock_path(out)))
        except LockHeld as e:
            raise BusyError(
                f"another mpack convert (pid {e.pid}) is writing {out}",
                hint="wait for it to finish, or stop it",
            ) from None
        except SourceNotFoundError:
            if not out.parent.is_dir():  # removed meanwhile: the message is right
                raise
            raise _takes_no_files(lock_path(out)) from None
        clean_stale(out)  # under the lock, no work directory of OUT belongs to a live run
        yield


def _make_dirs(d: Path) -> list[Path]:
    """Create ``d`` and its missing parents; return those created, outermost first."""
    missing = []
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    made: list[Path] = []
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            continue  # made by someone else meanwhile
        except OSError as e:
            _remove_empty(made)
            if e.errno == errno.ENOENT and m.parent.is_dir():
                raise _takes_no_files(m) from None
            raise os_error(e, m, "directory") from None
        made.append(m)
    return made


def _takes_no_files(path: Path) -> EnvironmentFailure:
    """Creating ``path`` failed with ENOENT although its directory exists: a file system that
    takes no new entries there (``/proc``, ``/sys``), which is the machine refusing, not a
    missing input (exit code 3)."""
    return EnvironmentFailure(
        f"{path.parent}: this file system takes no new files (creating {path.name} there "
        "failed: no such file or directory)",
        hint="write the output to a directory on an ordinary file system (-o)",
    )


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()


# --- what OUT holds ---------------------------------------------------------------------------


#: target keys compared, in the order differences are listed (then any others)
TARGET_KEYS = ("tp_size", "profile", "act_dtype", "fusion", "engine_version", "engine", "kernel")
MAX_LISTED_DIFFS = 3


@dataclass
class Existing:
    """What ``-o`` holds already (:func:`existing_state`)."""

    state: str  # absent | empty | same (this sidecar, intact) | other-sidecar | foreign
    loaded: tuple[dict[str, Any], str] | None = None  # its manifest and digest, when readable
    differences: list[str] = field(default_factory=list)  # other-sidecar: how, for people


def existing_state(
    out: Path,
    target: dict[str, Any],
    files: SourceRecords | None,
    common: bool,
    src: ResolvedSource,
) -> Existing:
    """What ``out`` holds: ``absent`` | ``empty`` | ``same`` (this sidecar, intact) |
    ``other-sidecar`` | ``foreign``, with the existing manifest and digest when they could be
    loaded, and for ``other-sidecar`` what differs from the planned one
    (:func:`sidecar_differences`).

    ``files(forms=None)`` gives the source's file records (it may wait for their hashes; ``forms``
    as in :func:`mpack.convert.source.hash_sources`); None: the caller replaces any sidecar
    anyway (``--force``), so an mpack sidecar is reported as ``other-sidecar`` without hashing
    the source (or listing differences). ``src``: the source, whose manifest record is compared.
    """
    if not out.exists():
        return Existing("absent")
    if out.is_dir() and not any(out.iterdir()):
        return Existing("empty")
    if not (out / MANIFEST_NAME).is_file():
        return Existing("foreign")
    try:
        loaded = load_manifest(out)
    except InputError as e:
        return Existing("other-sidecar", None, [f"its {MANIFEST_NAME} cannot be used: {e}"])
    m = loaded[0]
    if files is None:
        return Existing("other-sidecar", loaded)
    has_common = any(f["name"] == COMMON_NAME for f in m["files"])
    recorded = m["source"].get("files")
    now = files()
    if recorded != now and isinstance(recorded, list):
        forms = record_forms(recorded)
        if forms != record_forms(now):
            now = files(forms)  # written by an mpack that recorded other digests
    same = m["target"] == target and has_common == common and recorded == now
    broken = [
        f["name"]
        for f in m["files"]
        if not ((out / f["name"]).is_file() and (out / f["name"]).stat().st_size == f["size"])
    ]
    if same and not broken:
        return Existing("same", loaded)
    diffs = sidecar_differences(m, target, common, provenance(src, now))
    diffs += [f"its {n} is missing or has the wrong size" for n in broken[:MAX_LISTED_DIFFS]]
    return Existing("other-sidecar", loaded, diffs)


def sidecar_differences(
    m: dict[str, Any], target: dict[str, Any], common: bool, source: dict[str, Any]
) -> list[str]:
    """How the sidecar of manifest ``m`` differs from the one planned (``target``, whether it
    has ``common.safetensors``, the planned manifest's ``source``), one ``what old -> new``
    phrase per difference: target keys, pass-through, source repo / path / revision, and which
    source files changed, appeared or went away."""
    diffs = []
    old_t = m.get("target") or {}
    for k in [*TARGET_KEYS, *sorted((set(old_t) | set(target)) - set(TARGET_KEYS))]:
        if old_t.get(k) != target.get(k):
            diffs.append(f"{k} {_short(old_t.get(k))} -> {_short(target.get(k))}")
    had_common = any(f.get("name") == COMMON_NAME for f in m.get("files") or [])
    if had_common != common:
        yes = {True: f"with {COMMON_NAME}", False: f"without {COMMON_NAME}"}
        diffs.append(f"pass-through {yes[had_common]} -> {yes[common]}")
    old_s = m.get("source") if isinstance(m.get("source"), dict) else {}
    if old_s.get("kind") != source.get("kind"):
        diffs.append(f"source {_origin(old_s)} -> {_origin(source)}")
    else:
        for k, n in (("repo", 200), ("path", 4096), ("revision", 12)):
            if old_s.get(k) != source.get(k):
                diffs.append(f"source {k} {_short(old_s.get(k), n)} -> {_short(source.get(k), n)}")
    diffs += _file_differences(old_s.get("files"), source.get("files"))
    return diffs


def _file_differences(old: Any, new: Any) -> list[str]:
    """``source file X changed`` (``added``, ``removed``) for the first few, then a count."""
    if not isinstance(new, list):
        return []
    if not isinstance(old, list):
        return ["source files not recorded -> recorded"]
    a = {r.get("name"): r for r in old if isinstance(r, dict)}
    b = {r["name"]: r for r in new}
    changed = [
        f"source file {_short(n, 200)} {what}"
        for n, what in sorted(
            [(n, "changed") for n in a.keys() & b.keys() if a[n] != b[n]]
            + [(n, "added") for n in b.keys() - a.keys()]
            + [(n, "removed") for n in a.keys() - b.keys()],
            key=lambda x: str(x[0]),
        )
    ]
    if len(changed) > MAX_LISTED_DIFFS:
        more = len(changed) - MAX_LISTED_DIFFS
        changed = changed[:MAX_LISTED_DIFFS] + [f"{more} more source file(s) differ"]
    return changed


def _origin(s: dict[str, Any]) -> str:
    if s.get("kind") == "hub":
        return f"{_short(s.get('repo'), 200)}@{_short(s.get('revision'), 12)}"
    return f"{_short(s.get('kind'))} {_short(s.get('path'), 4096)}"


def _short(v: Any, n: int = 40) -> str:
    """A manifest value for a message: ``none`` for a missing one, cut to ``n`` characters."""
    return "none" if v is None else str(v)[:n]


# --- the stage --------------------------------------------------------------------------------


@dataclass
class Stage:
    """A sidecar being made at ``out`` (:func:`staged_sidecar`): ``work`` is the hidden directory
    its files go into; ``current`` (and no ``work``) when ``out`` already holds it."""

    out: Path
    work: Path | None = None
    current: tuple[dict[str, Any], str] | None = None  # up to date: OUT's manifest and digest

    @property
    def up_to_date(self) -> bool:
        return self.work is None

    def write_manifest(self, manifest: Mapping[str, Any]) -> str:
        """Write the manifest, the last file, into the work directory and flush the directory;
        return the manifest digest."""
        assert self.work is not None, "an up-to-date sidecar is not written"
        digest = write_manifest(self.work, manifest)
        fsync_dir(self.work)
        return digest


@contextlib.contextmanager
def staged_sidecar(
    out: Path,
    target: dict[str, Any],
    *,
    common: bool,
    src: ResolvedSource,
    files: SourceRecords,
    force: bool = False,
    timeline: Timeline | None = None,
) -> Iterator[Stage]:
    """Make the sidecar at ``out`` atomically (Note [atomic output]); call with ``out``'s lock held.

    First, what ``out`` holds (:func:`existing_state`, with ``target``, ``common``, ``src`` and
    ``files`` as there): this very sidecar yields a :class:`Stage` that is ``up_to_date`` and
    nothing is written. Otherwise the stage has a new work directory: when the ``with`` block
    ends normally it is swapped into place at ``out``; when it raises, it is removed. ``force``:
    replace another mpack sidecar at ``out`` (and redo this one). ``timeline``: where the time
    of the source hashing the check waits for (``hash-sources``) and of the swap goes.

    Raises:
        OutputExistsError: ``out`` holds files that are not an mpack sidecar, or (without
            ``force``) a different sidecar.
    """
    tl = timeline or Timeline()
    current = _current(out, target, common, src, None if force else files, tl)
    if current is not None:
        yield Stage(out, current=current)
        return
    work = _work_path(out, "tmp")
    work.mkdir()
    try:
        yield Stage(out, work)
        with tl.span("main", "swap"):
            _swap_into_place(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _current(
    out: Path,
    target: dict[str, Any],
    common: bool,
    src: ResolvedSource,
    files: SourceRecords | None,
    tl: Timeline,
) -> tuple[dict[str, Any], str] | None:
    """The manifest and digest of ``out`` when it holds this sidecar; None when it may be
    written (absent, empty, or a sidecar to replace: ``files`` None)."""
    if not out.exists():
        return None
    with tl.span("main", "hash-sources"):
        there = existing_state(out, target, files, common=common, src=src)
    if there.state == "same" and there.loaded is not None:  # "same" only with ``files``
        return there.loaded
    if there.state == "foreign":
        raise OutputExistsError(
            f"{out} already holds files that are not an mpack sidecar",
            hint="choose another -o directory, or remove it yourself (mpack does not "
            "delete what it did not write)",
        )
    if there.state == "other-sidecar" and files is not None:
        how = f" ({', '.join(there.differences)})" if there.differences else ""
        raise OutputExistsError(
            f"{out} already holds a different sidecar{how}",
            hint="pass --force to replace it, or choose another -o directory",
        )
    return None


# --- the swap ---------------------------------------------------------------------------------


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Put ``tmp`` at ``out``. An existing ``out`` is exchanged with ``tmp`` in one atomic step
    (``renameat2(RENAME_EXCHANGE)``: ``out`` never goes missing) and then removed from there;
    where the file system cannot exchange, it is renamed aside first. Either way, what a kill
    in between leaves is a work or old directory that the next run removes."""
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    if _exchange(tmp, out):
        fsync_dir(out.parent)
        _remove(tmp)  # the old OUT
        return
    old = _work_path(out, "old")
    os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    _remove(old)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no such call in this libc (glibc < 2.28, macOS)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically; False where the system or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))

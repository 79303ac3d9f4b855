"""Files an earlier start verified are not hashed again while they stay as they were (Note
[verified files] in mpack/cache.py), and everything else still is: a changed file, a record of
another manifest, ``--verify always``, a file that changes while it loads. Also the daemon's
early device start (Note [early device start] in runtime/cuda_vmm.py), on the stand-in driver.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mpack import cache
from mpack.errors import CorruptFileError, VerificationError
from mpack.runtime.allocation import plan_rank
from mpack.runtime.loader import HostDest, fill
from mpack.sidecar import rank_file_name
from tests.conftest import flip_byte
from tests.convert.helpers import cli
from tests.runtime.rt_helpers import DaemonProc, private_runtime
from tests.runtime.sidecar_factory import make_sidecar


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own, and no racy window: a file written just now is recorded."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MPACK_CACHE_DIR", str(root))
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    return root


def _fill(plan, verified):
    buf = bytearray(plan.size)
    stats = fill(plan, HostDest(memoryview(buf)), verified=verified)
    for r in plan.regions:
        assert buf[r.offset : r.offset + r.size] == r.path.read_bytes(), r.name
    return stats


def _file_bytes(plan) -> int:
    return sum(r.size for r in plan.regions)


def test_a_second_start_reads_the_verified_files_without_hashing_them(tmp_path, cache_root):
    plan = plan_rank(make_sidecar(tmp_path / "s", seed=1), 0)
    first = _fill(plan, cache.VerifiedFiles(plan.digest))
    assert (first.hashed, first.trusted) == (_file_bytes(plan), 0)
    assert (cache_root / "verified" / plan.digest).is_file()
    second = _fill(plan, cache.VerifiedFiles(plan.digest))
    assert (second.hashed, second.trusted) == (0, _file_bytes(plan))


def test_a_modified_file_is_hashed_again_and_refused_when_corrupt(tmp_path, cache_root):
    sc = make_sidecar(tmp_path / "s", seed=2)
    plan = plan_rank(sc, 0)
    _fill(plan, cache.VerifiedFiles(plan.digest))
    f = sc / rank_file_name(0, 1)
    before = os.stat(f)
    (r,) = [r for r in plan.regions if r.path == f]
    assert cache.VerifiedFiles(plan.digest).known(r.name, before, r.chunk_bytes)  # recorded
    flip_byte(f, f.stat().st_size - 100, 0x80)  # a write: ctime moves
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back; ctime cannot be
    assert os.stat(f).st_ctime_ns != before.st_ctime_ns
    verified = cache.VerifiedFiles(plan.digest)
    with open(f, "rb") as fh:
        assert verified.known(r.name, os.fstat(fh.fileno()), r.chunk_bytes) == frozenset()
    with pytest.raises(VerificationError, match="does not match the manifest"):
        _fill(plan, verified)


def test_a_record_of_another_manifest_is_not_trusted(tmp_path, cache_root):
    plan = plan_rank(make_sidecar(tmp_path / "s", seed=3), 0)
    _fill(plan, cache.VerifiedFiles(plan.digest))
    other = "0" * 64  # the record copied under another manifest's name
    data = (cache_root / "verified" / plan.digest).read_bytes()
    assert cache.write_entry("verified", other, data)
    again = cache.VerifiedFiles(other)
    assert all(again.known(r.name, os.stat(r.path), r.chunk_bytes) == set() for r in plan.regions)
    # the same files under a manifest that differs (another digest): hashed again
    m = json.loads((plan.sidecar / "mpack.json").read_text())
    (plan.sidecar / "mpack.json").write_text(json.dumps(m, indent=1))
    changed = plan_rank(plan.sidecar, 0)
    assert changed.digest != plan.digest
    stats = _fill(changed, cache.VerifiedFiles(changed.digest))
    assert (stats.hashed, stats.trusted) == (_file_bytes(changed), 0)


def _forge(plan) -> None:
    """A record that vouches for every file as it is now, whatever its bytes (what a record
    written by us could say: Note [verified files] trusts our own cache)."""
    v = cache.VerifiedFiles(plan.digest, trust=False)
    for r in plan.regions:
        n = len(r.chunk_sha256)
        assert v.add(r.name, os.stat(r.path), r.chunk_bytes, range(n), since_ns=1 << 62)
    assert v.save()


def test_verify_always_hashes_what_the_record_vouches_for(tmp_path, cache_root):
    sc = make_sidecar(tmp_path / "s", seed=4)
    f = sc / rank_file_name(0, 1)
    flip_byte(f, f.stat().st_size - 100, 0x80)
    plan = plan_rank(sc, 0)
    _forge(plan)
    trusted = fill(
        plan, HostDest(memoryview(bytearray(plan.size))), verified=cache.VerifiedFiles(plan.digest)
    )
    assert (trusted.hashed, trusted.trusted) == (0, _file_bytes(plan))  # auto believed it
    with pytest.raises(VerificationError, match="does not match the manifest"):
        fill(
            plan,
            HostDest(memoryview(bytearray(plan.size))),
            verified=cache.VerifiedFiles(plan.digest, trust=False),
        )


class _TouchOnFirstCopy(HostDest):
    """Changes the file's ctime (``utime``) while its first piece is being handed over."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        super().__init__(buf)
        self.path, self.touched = path, False

    def submit(self, i: int, offset: int, n: int) -> None:
        if not self.touched:
            self.touched = True
            os.utime(self.path)


def test_a_trusted_file_that_changes_while_loading_is_refused(tmp_path, cache_root):
    plan = plan_rank(make_sidecar(tmp_path / "s", seed=5), 0)
    _fill(plan, cache.VerifiedFiles(plan.digest))
    dest = _TouchOnFirstCopy(memoryview(bytearray(plan.size)), plan.regions[0].path)
    with pytest.raises(CorruptFileError, match="changed while loading"):
        fill(plan, dest, verified=cache.VerifiedFiles(plan.digest))
    # hashed, the same change is harmless: the bytes are proven, only not recorded
    dest = _TouchOnFirstCopy(memoryview(bytearray(plan.size)), plan.regions[0].path)
    stats = fill(plan, dest, verified=cache.VerifiedFiles(plan.digest, trust=False))
    assert stats.hashed == _file_bytes(plan)


def test_a_file_changed_just_now_is_not_recorded(tmp_path, cache_root, monkeypatch):
    monkeypatch.setattr(cache, "RACY_S", 3600.0)  # every file here is that young
    plan = plan_rank(make_sidecar(tmp_path / "s", seed=6), 0)
    _fill(plan, cache.VerifiedFiles(plan.digest))
    assert not (cache_root / "verified" / plan.digest).exists()
    stats = _fill(plan, cache.VerifiedFiles(plan.digest))
    assert (stats.hashed, stats.trusted) == (_file_bytes(plan), 0)


def test_a_record_that_is_not_one_is_ignored(tmp_path, cache_root):
    plan = plan_rank(make_sidecar(tmp_path / "s", seed=7), 0)
    for junk in (b"[]", b"{", b'{"version": 1, "manifest": "x", "files": 3}'):
        assert cache.write_entry("verified", plan.digest, junk)
        stats = _fill(plan, cache.VerifiedFiles(plan.digest))
        assert stats.hashed == _file_bytes(plan)
        (cache_root / "verified" / plan.digest).unlink()


def _ready_event(d: DaemonProc) -> dict:
    d.wait_ready()
    docs = [json.loads(x) for x in Path(d.out_path).read_text().splitlines() if x.strip()]
    (ready,) = [doc for doc in docs if doc.get("event") == "ready"]
    return ready


def test_serve_verify_always_refuses_what_auto_trusts(tmp_path, cache_root):
    """Through ``mpack serve``: a record in our own cache that vouches for a corrupt file lets
    ``--verify auto`` serve it (the trust model, docs/RUNTIME.md), ``--verify always`` hashes and
    refuses it; the ready event's ``startup`` says how many bytes were hashed and trusted."""
    sc = make_sidecar(tmp_path / "s", seed=8)
    f = sc / rank_file_name(0, 1)
    flip_byte(f, f.stat().st_size - 100, 0x80)
    plan = plan_rank(sc, 0)
    _forge(plan)
    env = {**private_runtime(tmp_path), "MPACK_CACHE_DIR": str(cache_root)}
    work = tmp_path / "w"
    work.mkdir()
    d = DaemonProc(sc, "cpu", env, work, "--json")
    try:
        startup = _ready_event(d)["startup"]
    finally:
        d.stop()
        d.close()
    assert (startup["verify"], startup["hashed_bytes"]) == ("auto", 0)
    assert startup["trusted_bytes"] == _file_bytes(plan)
    assert startup["fill_s"] >= 0 and startup["ready_s"] >= startup["fill_s"]
    r = cli("serve", sc, "--verify", "always", env=env, timeout=120)
    assert r.returncode != 0 and "does not match the manifest" in r.stderr, r.stderr
    bad = cli("serve", sc, "--verify", "never", env=env, timeout=120)
    assert bad.returncode == 2 and "--verify" in bad.stderr, bad.stderr


# --- the early device start, on the stand-in driver -------------------------------------------


def test_the_fill_uses_the_ring_the_early_start_made(tmp_path, monkeypatch):
    from mpack import cudadrv
    from mpack.runtime import cuda_vmm
    from tests.runtime.fake_driver import FakeDriver, install

    fake = FakeDriver()
    install(fake, monkeypatch)
    monkeypatch.setattr(cuda_vmm, "_prestarts", {})
    monkeypatch.setattr("mpack.device.no_cuda_here", lambda: False)
    plan = plan_rank(make_sidecar(tmp_path / "s", seed=9), 0)
    cuda_vmm.prestart(0)
    cuda_vmm.prestart(0)  # once per device
    (t,) = cuda_vmm._prestarts.values()
    t.join()
    assert fake.calls.count("cuInit") == 1 and fake.calls.count("cuMemHostAlloc") == 1
    assert cudadrv._contexts  # the primary context, retained by the thread
    export = cuda_vmm.DeviceExport.create(plan, 0)
    try:
        assert fake.calls.count("cuMemHostAlloc") == 1  # the fill took the thread's ring
        assert fake.calls.count("cuMemFreeHost") == 1  # and freed it when done
        data = fake.device_bytes(export.handle)
        for r in plan.regions:
            assert data[r.offset : r.offset + r.size] == r.path.read_bytes(), r.name
        assert fake.problems == []
    finally:
        export.close()
    export = cuda_vmm.DeviceExport.create(plan, 0)  # a second fill makes a ring of its own
    export.close()
    assert fake.calls.count("cuMemHostAlloc") == 2 and fake.live() == {}


def test_a_failed_early_start_leaves_the_fill_to_do_it(tmp_path, monkeypatch):
    from mpack.runtime import cuda_vmm
    from tests.runtime.fake_driver import FakeDriver, install

    fake = FakeDriver()
    install(fake, monkeypatch)
    monkeypatch.setattr(cuda_vmm, "_prestarts", {})
    monkeypatch.setattr("mpack.device.no_cuda_here", lambda: False)
    fake.fail["cuMemHostAlloc"] = 1
    plan = plan_rank(make_sidecar(tmp_path / "s", seed=10), 0)
    cuda_vmm.prestart(0)
    export = cuda_vmm.DeviceExport.create(plan, 0)
    try:
        assert fake.calls.count("cuMemHostAlloc") == 2  # the thread's failed; the fill's worked
        data = fake.device_bytes(export.handle)
        assert all(data[r.offset : r.offset + r.size] == r.path.read_bytes() for r in plan.regions)
    finally:
        export.close()
    assert fake.live() == {}

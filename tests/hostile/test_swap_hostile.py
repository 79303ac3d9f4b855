"""The end of `mpack convert` under hostile conditions (issue 24 items 2, 9 and 13).

What appears at -o during a run, a lock file another user deletes, a parent directory moved
under a run: real checkpoints (mpack.fixtures), real files, real processes. A run acts on the
file system from its first progress call, when every output file is open and the streaming
starts, as a second shell would. "Another user" is a forked child that drops to uid 65534, so
those tests need root (they skip without it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


from mpack import fsutil
from mpack.convert.options import ConvertOptions
from mpack.convert.output import lock_path, swap, work_dirs
from mpack.convert.output.lock import _work_path
from mpack.convert.pipeline import run_convert
from mpack.errors import BusyError, EnvironmentFailure, OutputExistsError
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import cli, cli_env, explain, manifest, snapshot

NOBODY = 65534


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def sidecar(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished sidecar of ``ckpt`` (TP 2, so that a TP-1 run over it needs --force)."""
    out = tmp_path_factory.mktemp("sidecar") / "sc"
    run_convert(ckpt, out, ConvertOptions(device="cpu", tp=2))
    return out


def once(action: Callable[[], None]) -> Callable[[str, int, int], None]:
    """A progress callback that runs ``action`` at its first call, mid-run."""
    done: list[bool] = []

    def progress(stage: str, n: int, total: int) -> None:
        if not done:
            done.append(True)
            action()

    return progress


def as_other_user(action: Callable[[], None]) -> None:
    """Run ``action`` in a forked child that has become uid/gid 65534 (nobody)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user (uid 65534)")
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 1
        try:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's action failed"


# --- item 2: the swap replaces only what the rules allow --------------------------------------


def _plant_dir(out: Path) -> None:
    out.mkdir()
    (out / "precious.txt").write_text("data")


def _plant_file(out: Path) -> None:
    out.write_text("data")


def _plant_link(out: Path) -> None:
    target = out.with_name("target")
    _plant_dir(target)
    out.symlink_to(target)


PLANTS = {"directory": _plant_dir, "file": _plant_file, "symlink": _plant_link}


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("kind", list(PLANTS))
def test_what_appears_at_out_during_the_run_is_left_and_the_run_fails(
    ckpt: Path, tmp_path: Path, kind: str, force: bool
) -> None:
    """`mkdir OUT; echo data > OUT/precious.txt` (or a file, or a link) while the run writes:
    the run fails naming OUT, whose content is as the user left it, and nothing else stays."""
    out = tmp_path / "out"
    progress = once(lambda: PLANTS[kind](out))
    with pytest.raises(OutputExistsError) as ei:
        run_convert(ckpt, out, ConvertOptions(device="cpu", force=force), progress=progress)
    assert f"{out} changed during the run" in ei.value.message, ei.value.message
    assert "it was left as it was" in ei.value.message
    if kind == "directory":
        assert "precious.txt" in ei.value.message
        assert (out / "precious.txt").read_text() == "data"
        assert os.listdir(out) == ["precious.txt"]
    elif kind == "file":
        assert "a regular file" in ei.value.message
        assert out.read_text() == "data"
    else:
        assert "a symbolic link" in ei.value.message
        assert out.is_symlink() and (tmp_path / "target" / "precious.txt").read_text() == "data"
    assert sorted(os.listdir(tmp_path)) == (["out", "target"] if kind == "symlink" else ["out"])


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_an_empty_directory_made_at_out_during_the_run_is_replaced(
    ckpt: Path, tmp_path: Path, force: bool
) -> None:
    out = tmp_path / "out"
    result = run_convert(
        ckpt, out, ConvertOptions(device="cpu", force=force), progress=once(out.mkdir)
    )
    assert result.up_to_date is False and (out / "mpack.json").is_file()
    assert os.listdir(tmp_path) == ["out"]


def test_force_replaces_a_sidecar_but_not_a_file_added_to_it_during_the_run(
    ckpt: Path, sidecar: Path, tmp_path: Path
) -> None:
    out = Path(shutil.copytree(sidecar, tmp_path / "out"))
    before = snapshot(out)
    progress = once(lambda: (out / "precious.txt").write_text("data"))
    with pytest.raises(OutputExistsError, match="precious.txt, which no sidecar has"):
        run_convert(ckpt, out, ConvertOptions(device="cpu", force=True), progress=progress)
    assert snapshot(out) == {**before, "precious.txt": snapshot(out)["precious.txt"]}
    assert (out / "precious.txt").read_text() == "data"
    assert manifest(out)["target"]["tp_size"] == 2  # the old sidecar, not the new one
    assert os.listdir(tmp_path) == ["out"]


def test_force_does_not_replace_a_directory_swapped_in_for_the_sidecar(
    ckpt: Path, sidecar: Path, tmp_path: Path
) -> None:
    """The sidecar at OUT is moved away and a directory of the user's put there mid-run."""
    out = Path(shutil.copytree(sidecar, tmp_path / "out"))

    def swap_in() -> None:
        out.rename(tmp_path / "kept")
        _plant_dir(out)

    with pytest.raises(OutputExistsError, match="precious.txt, which no sidecar has"):
        run_convert(ckpt, out, ConvertOptions(device="cpu", force=True), progress=once(swap_in))
    assert os.listdir(out) == ["precious.txt"]
    assert sorted(os.listdir(tmp_path)) == ["kept", "out"]


def _exchange(on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``renameat2(RENAME_EXCHANGE)`` as here (``on``), or missing, as on a libc without it."""
    if not on:
        monkeypatch.setattr(fsutil, "renameat2", lambda: None)
    elif fsutil.renameat2() is None:
        pytest.skip("no renameat2 in this libc")


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_force_replaces_a_sidecar_and_leaves_nothing(
    ckpt: Path, sidecar: Path, tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _exchange(exchange, monkeypatch)
    out = Path(shutil.copytree(sidecar, tmp_path / "out"))
    assert run_convert(ckpt, out, ConvertOptions(device="cpu", force=True)).up_to_date is False
    assert manifest(out)["target"]["tp_size"] == 1
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_a_file_added_between_the_check_and_the_exchange_is_swapped_back(
    ckpt: Path, sidecar: Path, tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last moment: a file lands in the old sidecar after it was checked, just before the
    exchange. What was swapped out is checked again, and exchanged back (or renamed back)."""
    _exchange(exchange, monkeypatch)
    out = Path(shutil.copytree(sidecar, tmp_path / "out"))
    before = snapshot(out)
    real = swap.exchange_at
    planted: list[bool] = []

    def late(dir_fd: int, a: str, b: str, error: Callable) -> bool:
        if not planted:
            planted.append(True)
            (out / "precious.txt").write_text("data")
        return real(dir_fd, a, b, error)

    monkeypatch.setattr(swap, "exchange_at", late)
    with pytest.raises(OutputExistsError, match="precious.txt, which no sidecar has"):
        run_convert(ckpt, out, ConvertOptions(device="cpu", force=True))
    assert planted
    assert (out / "precious.txt").read_text() == "data"
    assert {n: v for n, v in snapshot(out).items() if n != "precious.txt"} == before
    assert os.listdir(tmp_path) == ["out"]


def test_force_refuses_up_front_a_sidecar_holding_other_files(
    ckpt: Path, sidecar: Path, tmp_path: Path
) -> None:
    out = Path(shutil.copytree(sidecar, tmp_path / "out"))
    (out / "notes").mkdir()
    before = snapshot(out)
    r = cli("convert", ckpt, "-o", out, "--device", "cpu", "--force")
    assert r.returncode == 2, explain(r)
    assert f"error: {out} is not only an mpack sidecar: it holds notes, which no sidecar has" in (
        r.stderr
    )
    assert snapshot(out) == before and (out / "notes").is_dir()
    assert os.listdir(tmp_path) == ["out"]


# --- item 9: the lock in a directory others can write -----------------------------------------


def test_a_lock_file_deleted_by_another_user_does_not_let_a_second_run_in(
    ckpt: Path, tmp_path: Path
) -> None:
    """`mkdir -m 777 P`: another user deletes P/.mpack-*.lock under a live run; a second
    convert must still stop (exit 2), and leave the first run's work directory alone."""
    shared = tmp_path / "P"
    shared.mkdir()
    shared.chmod(0o777)
    out = shared / "out"
    seen: dict[str, object] = {}

    def meddle() -> None:
        fd = os.open(shared, os.O_RDONLY | os.O_DIRECTORY)
        try:
            as_other_user(lambda: os.unlink(lock_path(out).name, dir_fd=fd))
        finally:
            os.close(fd)
        seen["lock gone"] = not lock_path(out).exists()
        seen["live"] = live = work_dirs(out)
        seen["run"] = cli("convert", ckpt, "-o", out, "--device", "cpu")
        seen["survived"] = [p for p in live if (p / "rank-00-of-01.safetensors").is_file()]

    result = run_convert(ckpt, out, ConvertOptions(device="cpu"), progress=once(meddle))
    assert seen["lock gone"], "the other user could not delete the lock file"
    r = seen["run"]
    assert r.returncode == 2, explain(r)
    assert f"error: another mpack convert is writing {out} (its work directory" in r.stderr
    assert "wait for it to finish" in r.stderr
    assert len(seen["live"]) == 1 and seen["survived"] == seen["live"]
    assert result.up_to_date is False and (out / "mpack.json").is_file()
    assert os.listdir(shared) == ["out"]


def _hold_work_dir(out: Path) -> tuple[subprocess.Popen, Path]:
    """A process that made a work directory of ``out`` and holds its lock (as a live run does)
    until its stdin closes; no lock file, as after another user deleted it."""
    work = _work_path(out, "tmp")
    code = (
        "import fcntl, os, sys\n"
        "os.mkdir(sys.argv[1])\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "open(os.path.join(sys.argv[1], 'rank-00-of-01.safetensors'), 'wb').write(b'partial')\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(work)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc, work


def test_a_live_work_directory_is_never_removed(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder, work = _hold_work_dir(out)
    try:
        with pytest.raises(BusyError, match=f"another mpack convert is writing {out}"):
            run_convert(ckpt, out, ConvertOptions(device="cpu"))
        assert (work / "rank-00-of-01.safetensors").read_bytes() == b"partial"
        assert not out.exists() and not lock_path(out).exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # its holder is gone: the directory is a dead run's, and goes
    assert run_convert(ckpt, out, ConvertOptions(device="cpu")).up_to_date is False
    assert os.listdir(tmp_path) == ["out"]


def test_a_dead_runs_directory_keeps_what_mpack_did_not_write(ckpt: Path, tmp_path: Path) -> None:
    """A work or old directory of a dead run holding a file no sidecar has (a user's, swapped
    out at the last moment): its sidecar files go, the rest stays."""
    out = tmp_path / "out"
    old = _work_path(out, "old")
    old.mkdir()
    (old / "mpack.json").write_text("{}")
    (old / "precious.txt").write_text("data")
    assert run_convert(ckpt, out, ConvertOptions(device="cpu")).up_to_date is False
    assert os.listdir(old) == ["precious.txt"]
    assert sorted(os.listdir(tmp_path)) == sorted(["out", old.name])


# --- item 13: the parent of -o moved during the run -------------------------------------------


def test_a_parent_renamed_during_the_run_leaves_nothing_behind(ckpt: Path, tmp_path: Path) -> None:
    parent = tmp_path / "P"
    parent.mkdir()
    out = parent / "out"
    moved = tmp_path / "P2"
    with pytest.raises(EnvironmentFailure) as ei:
        run_convert(
            ckpt, out, ConvertOptions(device="cpu"), progress=once(lambda: parent.rename(moved))
        )
    assert ei.value.exit_code == 3
    # the library names its argument (Note [API wording]); the command line says -o
    assert f"{parent}: the directory of out was moved or removed during the run" in str(ei.value)
    assert os.listdir(tmp_path) == ["P2"]
    assert os.listdir(moved) == [], "a work directory or the lock was left in the moved parent"


def test_a_work_directory_renamed_by_another_user_is_still_removed(
    ckpt: Path, tmp_path: Path
) -> None:
    """In a parent others can write, another user renames the live work directory away: the
    run stops (exit 3, naming it) and removes it under its new name."""
    shared = tmp_path / "P"
    shared.mkdir()
    shared.chmod(0o777)
    out = shared / "out"

    def meddle() -> None:
        (work,) = work_dirs(out)
        fd = os.open(shared, os.O_RDONLY | os.O_DIRECTORY)
        try:
            as_other_user(lambda: os.rename(work.name, "elsewhere", src_dir_fd=fd, dst_dir_fd=fd))
        finally:
            os.close(fd)

    with pytest.raises(EnvironmentFailure, match="this run's work directory was moved") as ei:
        run_convert(ckpt, out, ConvertOptions(device="cpu"), progress=once(meddle))
    assert ei.value.exit_code == 3
    assert os.listdir(shared) == []

"""`mpack convert` under hostile conditions (red-team report, issue 11).

A source that changes under the run, two runs for one output, leftovers of dead runs, and
awkward output paths. Real checkpoints (mpack.fixtures), real files, real processes: the
in-process runs call ``run_convert`` itself, the others ``python -m mpack.cli``.
"""

from __future__ import annotations

import functools
import os
import pwd
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


from mpack.convert.options import ConvertOptions
from mpack.convert.output import check_apart, lock_path, output_path, work_dirs
from mpack.convert.output.lock import _work_path
from mpack.convert.pipeline import run_convert
from mpack.convert.source import SourceChangedError
from mpack.errors import BusyError, InputError, UsageError
from mpack.fixtures import make_checkpoint
from tests.conftest import flip_byte
from tests.convert.helpers import cli, cli_env, explain, manifest, snapshot, tensor_range

SHARD = "model-00003-of-00004.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four shards, like the report's ``model-00003-of-00004.safetensors``."""
    ck = make_checkpoint(tmp_path_factory.mktemp("sharded") / "a", max_shard_size="700KB")
    assert (ck / SHARD).is_file() and not (ck / "model-00005-of-00005.safetensors").exists()
    return ck


@pytest.fixture(scope="module")
def sharded_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model shape as ``sharded``, other weights: its shards are valid replacements."""
    return make_checkpoint(tmp_path_factory.mktemp("other") / "b", max_shard_size="700KB", seed=1)


def hidden(d: Path) -> list[str]:
    """Every hidden name in ``d``: work, old-sidecar and lock files all start with a dot."""
    return sorted(n for n in os.listdir(d) if n.startswith("."))


# --- 1: a source that changes under the run ---------------------------------------------------


def _replace(shard: Path, other: Path) -> None:
    shutil.copyfile(other, shard.with_name("new.safetensors"))
    os.replace(shard.with_name("new.safetensors"), shard)  # `mv new.safetensors SRC/...`


def _append(shard: Path, other: Path) -> None:
    with open(shard, "ab") as f:
        f.write(b"\0" * 64)


def _rewrite(shard: Path, other: Path) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    a, b = tensor_range(shard, name)
    flip_byte(shard, (a + b) // 2)  # same size, same inode, other bytes


def _remove(shard: Path, other: Path) -> None:
    shard.unlink()


CHANGES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "replaced": (_replace, "was replaced by another file"),
    "appended": (_append, "changed size from"),
    "rewritten": (_rewrite, "was modified in place"),
    "removed": (_remove, "disappeared"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_source_changed_during_convert_is_refused(
    change: str, sharded: Path, sharded_other: Path, tmp_path: Path
) -> None:
    src = Path(shutil.copytree(sharded, tmp_path / "src"))
    out = tmp_path / "out"
    fn, what = CHANGES[change]
    changed: list[str] = []

    def progress(stage: str, done: int, total: int) -> None:
        if not changed:  # the first call: every header is parsed, the streaming starts
            changed.append(stage)
            fn(src / SHARD, sharded_other / SHARD)

    with pytest.raises(SourceChangedError) as ei:
        run_convert(src, out, ConvertOptions(device="cpu"), progress=progress)
    assert changed, "the source was never changed: progress was not called"
    e = ei.value
    assert isinstance(e, InputError) and e.exit_code == 2
    assert f"{src / SHARD} {what}" in e.message, e.message
    assert "rerun once the source is stable" in (e.hint or "")
    assert sorted(os.listdir(tmp_path)) == ["src"], "output, work dir or lock left behind"


# --- 9, 10: one run at a time per output ------------------------------------------------------


def test_second_convert_to_the_same_output_is_busy(ckpt: Path, tmp_path: Path) -> None:
    """Two real converts to one -o: while this process's run writes, a `mpack convert` with
    other options is refused (exit 2, naming our pid), and leaves our work directory alone."""
    out = tmp_path / "out"
    seen: dict[str, object] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if not seen:
            seen["live"] = live = work_dirs(out)
            seen["run"] = cli("convert", ckpt, "-o", out, "--tp", "2", "--device", "cpu")
            seen["survived"] = [p for p in live if (p / "rank-00-of-01.safetensors").is_file()]

    result = run_convert(ckpt, out, ConvertOptions(device="cpu"), progress=progress)
    r = seen["run"]
    assert r.returncode == 2, explain(r)
    assert f"error: another mpack convert (pid {os.getpid()}) is writing {out}" in r.stderr
    assert "wait for it to finish" in r.stderr
    assert len(seen["live"]) == 1 and seen["survived"] == seen["live"]
    assert result.up_to_date is False
    assert manifest(out)["target"]["tp_size"] == 1  # ours, not replaced by the second run
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _hold_lock(out: Path) -> subprocess.Popen:
    """A process holding ``out``'s lock until its stdin closes; it prints its pid when it has it."""
    code = (
        "import sys\n"
        "from mpack.fsutil import LockFile\n"
        "with LockFile(sys.argv[1]) as lk:\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(lock_path(out))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_busy_output_spares_a_live_work_dir_and_a_dead_runs_is_removed(
    ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        live = _work_path(out, "tmp")
        live.mkdir()
        (live / "rank-00-of-01.safetensors").write_bytes(b"partial")
        with pytest.raises(BusyError, match=f"another mpack convert \\(pid {holder.pid}\\)"):
            run_convert(ckpt, out, ConvertOptions(device="cpu"))
        assert live.is_dir() and (live / "rank-00-of-01.safetensors").read_bytes() == b"partial"
        assert not out.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # the holder is gone: what it left is stale, whatever pid its name holds
    legacy = tmp_path / f".out.mpack-tmp-{os.getpid()}-cafef00d"  # a live pid, an old name
    legacy.mkdir()
    result = run_convert(ckpt, out, ConvertOptions(device="cpu"))
    assert result.up_to_date is False
    assert not live.exists() and not legacy.exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_run_killed_holding_the_lock_leaves_nothing_that_blocks(
    ckpt: Path, tmp_path: Path
) -> None:
    """A run that dies holding the lock leaves its lock file and work directory behind; the
    next run takes the lock (the kernel released it) and removes the work directory."""
    out = tmp_path / "out"
    work = _work_path(out, "tmp")
    code = (
        "import os, sys\n"
        "from mpack.fsutil import LockFile\n"
        "LockFile(sys.argv[1]).__enter__()\n"
        "os.mkdir(sys.argv[2])\n"
        "os._exit(9)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(lock_path(out)), str(work)], env=cli_env())
    assert r.returncode == 9 and lock_path(out).is_file() and work.is_dir()
    assert run_convert(ckpt, out, ConvertOptions(device="cpu")).up_to_date is False
    assert sorted(os.listdir(tmp_path)) == ["out"]


# --- 11: a --force run killed at the swap -----------------------------------------------------


def test_old_sidecar_copies_are_removed_by_the_next_run(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_convert(ckpt, out, ConvertOptions(device="cpu"))
    planted = [
        tmp_path / ".out.mpack-old-4242-deadbeef",  # an older mpack's name
        _work_path(out, "old"),
        _work_path(out, "tmp"),  # an exchange killed before the old copy was removed
    ]
    for p in planted:
        shutil.copytree(out, p)
    others = [tmp_path / ".other.mpack-old-4242-deadbeef", tmp_path / ".out.mpack-old-x"]
    for p in others:  # not ours: another output's, or a name no mpack writes
        p.mkdir()
    result = run_convert(ckpt, out, ConvertOptions(device="cpu"))
    assert result.up_to_date is True
    assert not any(p.exists() for p in planted)
    assert hidden(tmp_path) == sorted(p.name for p in others)


# --- 12: awkward output paths -----------------------------------------------------------------


def test_mount_point_output_is_refused_up_front(ckpt: Path, tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount a tmpfs in a private mount namespace")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        'mount -t tmpfs mpack-test "$1" && exec "$2" -m mpack.cli convert "$3" -o "$1" --device cpu'
    )
    args = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
    probe = subprocess.run([*args[:4], "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    r = subprocess.run(
        [*args, str(mnt), sys.executable, str(ckpt)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=180,
    )
    assert r.returncode == 2, explain(r)
    assert f"-o {mnt} ({mnt}) is a mount point" in r.stderr, r.stderr
    assert "use a subdirectory of it" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["mnt"] and os.listdir(mnt) == []


def test_symlink_output_writes_at_its_target_and_keeps_the_link(ckpt: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    result = run_convert(ckpt, link, ConvertOptions(device="cpu"))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert result.out == real
    assert (real / "mpack.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert run_convert(ckpt, link, ConvertOptions(device="cpu")).up_to_date is True


def test_output_reaching_into_the_source_through_a_symlink_is_refused(
    ckpt: Path, tmp_path: Path
) -> None:
    src = Path(shutil.copytree(ckpt, tmp_path / "src"))
    before = snapshot(src)
    (tmp_path / "link").symlink_to(src)
    with pytest.raises(UsageError, match=f"lies inside the source checkpoint {src}"):
        run_convert(src, tmp_path / "link" / "sidecar", ConvertOptions(device="cpu"))
    assert snapshot(src) == before and sorted(os.listdir(src)) == sorted(before)


def test_symlinked_source_with_output_inside_the_real_source_is_refused(
    ckpt: Path, tmp_path: Path
) -> None:
    """`mpack convert link -o real/sidecar` where `link -> real`: the two paths look apart, but
    the sidecar would land inside the checkpoint. The source is resolved before the check
    (check_apart resolves it itself, whoever calls it)."""
    real = Path(shutil.copytree(ckpt, tmp_path / "real"))
    before = snapshot(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    for out in (real / "sidecar", real):
        with pytest.raises(UsageError, match=f"lies inside the source checkpoint {real}"):
            run_convert(link, out, ConvertOptions(device="cpu"))
        with pytest.raises(UsageError, match=f"lies inside the source checkpoint {real}"):
            check_apart(output_path(out), link)  # the unresolved link, as a caller may pass it
    assert snapshot(real) == before and sorted(os.listdir(real)) == sorted(before)
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


@pytest.mark.parametrize("case", ["one-target", "several-out", "several-target-dir"])
def test_a_symlinked_output_into_the_source_is_refused_for_one_target_or_several(
    ckpt: Path, tmp_path: Path, case: str
) -> None:
    """The same place check for every sidecar a run writes (output.target_output): ``-o link``
    with ``link -> SRC/sub``, for one target and for several, and ``OUT/<target> -> SRC/sub``
    for several (written into the source before). Nothing is written in the source."""
    src = Path(shutil.copytree(ckpt, tmp_path / "src"))
    before = snapshot(src)
    tp = [1] if case == "one-target" else [1, 2]
    if case == "several-target-dir":
        out = tmp_path / "out"
        out.mkdir()
        (out / "tp1-w8a16-bfloat16").symlink_to(src / "sub")
        named = flag = f"{out / 'tp1-w8a16-bfloat16'} ({src / 'sub'})"
    else:
        out = tmp_path / "link"
        out.symlink_to(src / "sub")
        named = f"out={str(src / 'sub')!r}"  # the library's own words (Note [API wording])
        flag = f"-o {src / 'sub'}"  # the same error under the command line
    with pytest.raises(UsageError) as e:
        run_convert(src, out, ConvertOptions(device="cpu", tp=tp))
    assert str(e.value).startswith(f"{named} lies inside the source checkpoint {src}")
    assert e.value.exit_code == 2 and "symbolic link" in (e.value.hint or "")
    assert snapshot(src) == before and sorted(os.listdir(src)) == sorted(before)
    p = cli("convert", src, "-o", out, "--tp", ",".join(map(str, tp)), "--device", "cpu")
    assert p.returncode == 2, p.stderr
    assert f"{flag} lies inside the source checkpoint {src}" in p.stderr, p.stderr
    assert sorted(os.listdir(src)) == sorted(before)


def test_source_inside_the_output_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """A --force run onto a sidecar that holds the checkpoint would remove the checkpoint."""
    sc = tmp_path / "sc"
    run_convert(ckpt, sc, ConvertOptions(device="cpu", tp=2))
    src = Path(shutil.copytree(ckpt, sc / "ckpt"))
    before = snapshot(sc)
    with pytest.raises(UsageError, match=f"the source checkpoint {src} lies inside out='{sc}'"):
        run_convert(src, sc, ConvertOptions(device="cpu", force=True))
    assert snapshot(sc) == before


def test_empty_output_is_refused(ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with pytest.raises(UsageError, match="out is empty") as ei:  # the API's words
        run_convert(ckpt, "", ConvertOptions(device="cpu"))
    assert "out='./sidecar'" in (ei.value.hint or "")
    assert os.listdir(cwd) == []


def test_cli_output_that_is_the_current_directory_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """`-o ''` is refused as empty; `-o ../cwd` from inside cwd as the current directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ino = cwd.stat().st_ino
    for out, said in (("", "-o is empty"), ("../cwd", f"({cwd}) is the current directory")):
        r = subprocess.run(
            [sys.executable, "-m", "mpack.cli", "convert", str(ckpt), "-o", out, "--device", "cpu"],
            capture_output=True,
            text=True,
            env=cli_env(),
            cwd=cwd,
            timeout=180,
        )
        assert r.returncode == 2, explain(r)
        assert said in r.stderr, r.stderr
        assert "name a new directory, e.g. -o ./sidecar" in r.stderr
        assert cwd.stat().st_ino == ino and os.listdir(cwd) == []
        assert sorted(os.listdir(tmp_path)) == ["cwd"]


def test_output_with_a_long_name(ckpt: Path, tmp_path: Path) -> None:
    """A 240-byte name is valid; the hidden work, old and lock names must not grow with it."""
    out = tmp_path / ("s" * 240)
    run_convert(ckpt, out, ConvertOptions(device="cpu"))
    assert (out / "mpack.json").is_file()
    run_convert(ckpt, out, ConvertOptions(device="cpu", force=True))  # the swap's old directory too
    assert sorted(os.listdir(tmp_path)) == [out.name]
    names = {p.name for p in (_work_path(out, "tmp"), _work_path(out, "old"), lock_path(out))}
    short = {p.name for p in (_work_path(tmp_path / "s", "tmp"), lock_path(tmp_path / "s"))}
    assert {len(n) for n in names} <= {len(n) for n in short} and max(map(len, names)) < 40


# --- issue 24 item 12: bad -o and a full disk are exit 2 and 3, not 1 -------------------------


def _in_mount_namespace(script: str, *args: str | os.PathLike) -> subprocess.CompletedProcess:
    """Run ``sh -c script sh ARGS`` as root of a private user and mount namespace, where it may
    mount (a tmpfs, a bind mount) and whatever it mounts goes away with it; skip where no such
    namespace can be made. ``$PYTHON`` runs this interpreter."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) to mount in a private mount namespace")
    ns = [unshare, "--user", "--map-root-user", "--mount"]
    probe = subprocess.run([*ns, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    return subprocess.run(
        [*ns, "sh", "-c", script, "sh", *map(str, args)],
        capture_output=True,
        text=True,
        env=cli_env({"PYTHON": sys.executable}),
        timeout=180,
    )


def test_output_name_longer_than_the_file_system_takes_is_refused(
    ckpt: Path, tmp_path: Path
) -> None:
    r = cli("convert", ckpt, "-o", tmp_path / ("s" * 256), "--device", "cpu")
    assert r.returncode == 2, explain(r)
    assert "(256 characters) is 256 bytes long, more than the 255 a file name may have" in (
        r.stderr
    )
    assert "choose a shorter name" in r.stderr and "Traceback" not in r.stderr
    deep = tmp_path.joinpath(*["d" * 200] * 21)  # every name fits, the whole path does not
    with pytest.raises(UsageError, match="too long for the sidecar's files in it"):
        run_convert(ckpt, deep, ConvertOptions(device="cpu"))
    assert os.listdir(tmp_path) == []


def test_output_under_the_home_of_no_such_user_is_refused(ckpt: Path, tmp_path: Path) -> None:
    user = "nosuchuser"
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
    r = subprocess.run(
        [sys.executable, "-m", "mpack.cli", "convert", str(ckpt), "-o", f"~{user}/x"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        timeout=180,
    )
    assert r.returncode == 2, explain(r)
    assert f"error: -o ~{user}/x: ~{user} names a home directory, but there is no user {user}" in (
        r.stderr
    )
    assert os.listdir(tmp_path) == []


def test_bind_mount_output_is_refused_up_front(ckpt: Path, tmp_path: Path) -> None:
    """A bind mount of a directory of the same file system: same device, so only the mount
    table tells; the rename at the end would fail (EBUSY) after the whole conversion."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    r = _in_mount_namespace(
        'mount --bind "$1" "$2" && exec "$PYTHON" -m mpack.cli convert "$3" -o "$2" --device cpu',
        tmp_path / "a",
        tmp_path / "b",
        ckpt,
    )
    assert r.returncode == 2, explain(r)
    assert f"-o {tmp_path / 'b'} ({tmp_path / 'b'}) is a mount point" in r.stderr, r.stderr
    assert "convert: " not in r.stderr, "refused only after the conversion"
    assert sorted(os.listdir(tmp_path)) == ["a", "b"] and os.listdir(tmp_path / "a") == []


def test_full_disk_names_the_file(ckpt: Path, tmp_path: Path) -> None:
    """A 256 KiB tmpfs as -o's parent: exit 3, the message names the file that did not fit,
    and the run leaves nothing there."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = _in_mount_namespace(
        'mount -t tmpfs -o size=256k mpack-test "$1" || exit 99\n'
        '"$PYTHON" -m mpack.cli convert "$2" -o "$1/out" --device cpu; rc=$?\n'
        'echo "left: $(ls -A "$1")" >&2; exit $rc',
        mnt,
        ckpt,
    )
    assert r.returncode == 3, explain(r)
    assert re.search(
        rf"error: {re.escape(str(mnt))}/\.mpack-[0-9a-f]{{12}}\.tmp-[0-9a-f]{{8}}/"
        rf"[a-z0-9_.-]+: No space left on device while writing the sidecar "
        rf"{re.escape(str(mnt))}/out",
        r.stderr,
    ), r.stderr
    assert "?:" not in r.stderr
    assert r.stderr.splitlines()[-1] == "left: ", r.stderr


# --- round 3: the environment, deep JSON, oversized headers ------------------------------------


@pytest.mark.parametrize("value", ["0", "-1", "nan", "abc", ""])
def test_a_bad_progress_interval_is_refused_not_a_flood(
    ckpt: Path, tmp_path: Path, value: str
) -> None:
    """``MPACK_PROGRESS_EVERY=0`` (or -1, nan) wrote MBs of progress lines for a 2 s convert, and
    ``abc`` or empty was an internal error: now exit 2 naming the variable and its value, before
    anything is written; empty means the default (README, "Environment variables")."""
    out = tmp_path / "out"
    r = cli("convert", ckpt, "-o", out, "--device", "cpu", env={"MPACK_PROGRESS_EVERY": value})
    assert len(r.stderr) < 10_000, f"{len(r.stderr)} bytes on stderr"
    if value == "":
        assert r.returncode == 0, explain(r)
        return
    assert r.returncode == 2, explain(r)
    assert r.stderr.startswith(f"error: MPACK_PROGRESS_EVERY='{value}': must be a number from 0.1 ")
    assert "hint: set MPACK_PROGRESS_EVERY" in r.stderr and "internal error" not in r.stderr
    assert os.listdir(tmp_path) == [], "output, work dir or lock left behind"


@pytest.mark.parametrize(
    ("value", "expect"),
    [("", 5.0), ("  ", 5.0), ("0.5", 0.5), (" 2 ", 2.0), ("1e1", 10.0), ("86400", 86400.0)]
    + [(v, None) for v in ("0", "-0", "-1", "0.09", "nan", "inf", "-inf", "1e400", "86401", "x")],
)
def test_numeric_environment_variables_have_one_checked_parse(
    value: str, expect: float | None, monkeypatch
) -> None:
    import mpack
    from mpack import cli, env

    monkeypatch.setenv("MPACK_PROGRESS_EVERY", value)
    low, high = env.PROGRESS_EVERY_RANGE
    assert f"{low:g} to {high:g}" in cli.ENVIRONMENT["MPACK_PROGRESS_EVERY=S"]  # the help says it
    read = functools.partial(mpack.env_number, "MPACK_PROGRESS_EVERY", 5.0, low=low, high=high)
    if expect is not None:
        assert read() == expect
        return
    with pytest.raises(UsageError, match=r"MPACK_PROGRESS_EVERY=.*: must be a number") as e:
        read()
    assert e.value.exit_code == 2 and repr(value) in e.value.message


def _deep(n: int = 200_000) -> str:
    return "[" * n + "]" * n


def test_a_config_nested_200000_deep_names_the_file(ckpt: Path, tmp_path: Path) -> None:
    src = Path(shutil.copytree(ckpt, tmp_path / "src"))
    cfg = src / "config.json"
    cfg.write_text(cfg.read_text().rstrip()[:-1] + ', "x": ' + _deep() + "}")
    r = cli("convert", src, "-o", tmp_path / "out", "--device", "cpu")
    assert r.returncode == 2, explain(r)
    assert f"error: {cfg}: malformed JSON (nested too deeply)" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("model.safetensors.index.json", _deep(), "malformed index (nested too deeply)"),
        ("model.safetensors.index.json", '{"weight_map": ', "malformed index (Expecting value"),
        ("config.json", "[1, 2]", "holds a JSON list, not an object"),
    ],
)
def test_outside_json_that_does_not_parse_is_bad_input(
    sharded: Path, tmp_path: Path, name: str, text: str, says: str
) -> None:
    src = Path(shutil.copytree(sharded, tmp_path / "src"))
    (src / name).write_text(text)
    r = cli("convert", src, "-o", tmp_path / "out", "--device", "cpu")
    assert r.returncode == 2, explain(r)
    assert f"error: {src / name}: {says}" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_shard_header_over_100_mb_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """A valid header padded with spaces past 100 000 000 bytes converted; safetensors itself
    refuses such a file (docs/FORMAT.md), and so does mpack, naming the file and the length."""
    src = Path(shutil.copytree(ckpt, tmp_path / "src"))
    shard = src / "model.safetensors"
    data = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + hlen].rstrip()
    big = 100_000_008
    with open(shard, "wb") as f:  # same tensors, same data: only the header's padding grew
        f.write(struct.pack("<Q", big) + raw + b" " * (big - len(raw)) + data[8 + hlen :])
    r = cli("convert", src, "-o", tmp_path / "out", "--device", "cpu")
    assert r.returncode == 2, explain(r)
    assert f"error: {shard}: header length {big} is over the 100000000 bytes" in r.stderr
    assert not (tmp_path / "out").exists()

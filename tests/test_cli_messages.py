"""Messages that point the right way (issue 23): verify's "source not checked" said once and
``--require-source`` for CI, the hint that offers ``--fuse none``, a GPU asked for where there
is none, and an output on a file system that takes no files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpack.convert as mc
from mpack.device import no_cuda_here
from mpack.errors import SourceNotFoundError, UnsupportedSchemeError
from mpack.fixtures import make_checkpoint
from mpack.verify import verify
from tests.convert.helpers import cli, explain, messages


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A sidecar whose recorded source directory is gone (moved): ``(old path, new path,
    sidecar)``."""
    root = tmp_path_factory.mktemp("moved")
    ck = make_checkpoint(root / "ck", arch="llama", scheme="FP8", layers=1)
    mc.convert(ck, root / "sc", device="cpu")
    ck.rename(root / "ck-moved")
    return ck, root / "ck-moved", root / "sc"


# --- verify without a source --------------------------------------------------------------------


def test_source_not_checked_is_said_once(moved) -> None:
    ck, _, sc = moved
    r = cli("verify", sc)
    assert r.returncode == 0, explain(r)
    (line,) = [x for x in r.stdout.splitlines() if "not checked" in x]
    assert line.startswith(f"source not checked: the recorded source directory {ck} is not there")
    assert line.count("source not checked") == 1, line
    assert json.loads(cli("verify", sc, "--json").stdout)["source_note"].startswith(
        f"the recorded source directory {ck} is not there; only the files were checked"
    )


def test_require_source_fails_without_one(moved) -> None:
    ck, _, sc = moved
    r = cli("verify", sc, "--require-source")
    assert r.returncode == 2, explain(r)
    assert r.stdout == ""  # no "ok" line for a check that was required and did not run
    first, hint = messages(r.stderr).splitlines()[:2]
    assert first.startswith(
        f"error: {sc}: --require-source: source not checked: the recorded source directory {ck} "
        "is not there"
    ), first
    assert hint.startswith("  hint: pass --source DIR") and "--require-source" in hint
    doc = json.loads(cli("verify", sc, "--require-source", "--json").stdout)
    assert (doc["ok"], doc["error"]["code"], doc["error"]["exit_code"]) == (
        False,
        "SourceNotFoundError",
        2,
    )


def test_require_source_passes_with_one(moved) -> None:
    _, ck, sc = moved
    r = cli("verify", sc, "--require-source", "--source", ck, "--json")
    assert r.returncode == 0, explain(r)
    assert json.loads(r.stdout)["source_checked"] is True


def test_require_source_in_python(moved) -> None:
    _, ck, sc = moved
    assert verify(sc).ok  # as before: the checksums alone pass
    # the API's words (Note [API wording]); the CLI says --require-source
    with pytest.raises(SourceNotFoundError, match="require_source=True: source not checked"):
        verify(sc, require_source=True)
    with pytest.raises(SourceNotFoundError, match="require_source=True: source not checked"):
        mc.verify(sc, require_source=True)
    assert mc.verify(sc, source=ck, require_source=True).source_checked is True


# --- hints --------------------------------------------------------------------------------------


def test_the_fuse_none_hint_says_vllm_cannot_load_it(tmp_path) -> None:
    ck = make_checkpoint(tmp_path / "ck", arch="llama", scheme="FP8", layers=1)
    config = json.loads((ck / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedSchemeError) as e:
        mc.convert(ck, tmp_path / "out", device="cpu")
    hint = e.value.hint or ""  # the API's words (Note [API wording]): convert(fuse=...)
    assert "fuse='none' tp=1" in hint
    assert "--load-format mpack cannot load such a sidecar (it needs fuse='vllm')" in hint


# --- a GPU where there is none --------------------------------------------------------------------

NO_GPU = pytest.mark.skipif(not no_cuda_here(), reason="this machine may have a CUDA device")

#: convert on ``sys.argv[3]`` in Python; print the error, and whether torch was imported
CONVERT_ON = """
import sys
import mpack.convert as mc
from mpack.errors import UsageError
try:
    mc.convert(sys.argv[1], sys.argv[2], device=sys.argv[3])
except UsageError as e:
    print(e.message, "|", e.hint, "|", "torch" in sys.modules)
"""


@NO_GPU
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_asked_for_where_there_is_none_fails_up_front(tmp_path, device) -> None:
    ck = make_checkpoint(tmp_path / "ck", arch="llama", scheme="FP8", layers=1)
    out = tmp_path / "out"
    r = cli("convert", ck, "-o", out, "--device", device)
    assert r.returncode == 2, explain(r)
    assert r.stderr == (  # no progress line: nothing started
        f"error: --device {device}: no CUDA device here\n"
        "  hint: use --device cpu (identical bytes)\n"
    )
    assert os.listdir(tmp_path) == ["ck"]  # no output, no lock, no work directory
    said = subprocess.run(
        [sys.executable, "-c", CONVERT_ON, str(ck), str(out), device],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert said.stdout.strip() == (  # the API's words in Python (Note [API wording])
        f"device={device!r}: no CUDA device here | use device='cpu' (identical bytes) | False"
    ), said.stderr  # refused before torch was imported
    assert os.listdir(tmp_path) == ["ck"]


# --- a file system that takes no new files --------------------------------------------------------


@pytest.mark.skipif(not os.path.isfile("/proc/self/status"), reason="needs Linux's /proc")
@pytest.mark.parametrize("out", ["/proc/x", "/proc/x/y"])
def test_output_in_proc_is_an_environment_error(tmp_path, out) -> None:
    ck = make_checkpoint(tmp_path / "ck", arch="llama", scheme="FP8", layers=1)
    r = cli("convert", ck, "-o", out, "--json")
    assert r.returncode == 3, explain(r)
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "EnvironmentFailure" and err["message"].startswith("/proc"), err
    assert "no such lock file" not in err["message"]

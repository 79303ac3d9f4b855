"""Issue 42, item 1 (and item 5's verify part): ``mpack verify``'s bad inputs and what it says.

* a ``--source`` lacking a file the manifest records: exit 2 naming the file (was: exit 1,
  "internal error");
* a ``--source`` that is another checkpoint: a hint about ``--source`` (was: "re-convert");
* ``--device`` without ``--forward``: refused with the fix (was: ignored);
* ``mpack.convert.verify`` returns a typed result, as ``convert()`` does (was: a dict);
* progress on stderr as ``convert`` shows it, none under ``--json`` or ``-q``.

Every CLI run is a real ``mpack`` subprocess with its output piped, as CI sees it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import mpack.convert as mc
from mpack.errors import SourceNotFoundError, UsageError, VerificationError
from mpack.fixtures import make_checkpoint
from mpack.sidecar import GENERATION_CONFIG_NAME, load_manifest
from mpack.verify import Verification, verify
from tests.convert.helpers import cli, explain, messages


@pytest.fixture(scope="module")
def lacking(converted, tmp_path_factory) -> tuple[Path, Path]:
    """``(sidecar, a copy of its checkpoint without generation_config.json)``."""
    ck, sc = converted
    recorded = {f["name"] for f in load_manifest(sc)[0]["source"]["files"]}
    assert GENERATION_CONFIG_NAME in recorded, recorded  # the premise: the manifest records it
    copy = Path(shutil.copytree(ck, tmp_path_factory.mktemp("lacking") / "ck"))
    (copy / GENERATION_CONFIG_NAME).unlink()
    return sc, copy


@pytest.fixture(scope="module")
def other(converted, tmp_path_factory) -> Path:
    """Another checkpoint of the same shapes (another seed): the wrong ``--source``."""
    return make_checkpoint(
        tmp_path_factory.mktemp("other") / "ck", arch="llama", scheme="FP8", layers=1, seed=7
    )


# --- a source that lacks a recorded file ---------------------------------------------------------


def test_a_source_lacking_a_recorded_file_is_exit_2_naming_it(lacking) -> None:
    sc, ck = lacking
    r = cli("verify", sc, "--source", ck)
    assert r.returncode == 2, explain(r)
    err = messages(r.stderr)
    assert err.startswith(f"error: {ck}: no {GENERATION_CONFIG_NAME}, a file the sidecar {sc}")
    assert "internal error" not in err and "Traceback" not in err
    assert "hint: pass as --source the checkpoint directory" in err, err
    doc = json.loads(cli("verify", sc, "--source", ck, "--json").stdout)
    assert doc["ok"] is False
    assert (doc["error"]["code"], doc["error"]["exit_code"]) == ("SourceNotFoundError", 2)
    assert doc["error"]["file"] == str(ck / GENERATION_CONFIG_NAME)


def test_the_library_raises_the_same_before_any_work(lacking) -> None:
    sc, ck = lacking
    with pytest.raises(SourceNotFoundError, match=f"no {GENERATION_CONFIG_NAME}, a file") as e:
        verify(sc, source=ck)
    assert "pass as source the checkpoint" in (e.value.hint or "")  # the API's words


# --- a source that is another checkpoint ---------------------------------------------------------


def test_another_checkpoint_as_source_gets_a_hint_about_source(converted, other) -> None:
    ck, sc = converted
    r = cli("verify", sc, "--source", other)
    assert r.returncode == 2, explain(r)
    err = messages(r.stderr)
    problems, _, hint = err.partition("\n  hint: ")
    assert "source model.safetensors: differs from the file the sidecar was made from" in problems
    assert "(not listed)" in problems and "differs from the tensor re-derived" not in problems
    assert hint.startswith(f"--source {other} is not the checkpoint {sc} was made from"), hint
    assert "pass that one as --source" in hint
    assert "regenerate it" not in hint  # the sidecar is fine: the source is the wrong one
    assert f"mpack convert {other} -o {sc} --force" in hint  # only for this checkpoint instead


def test_the_right_source_still_passes(converted) -> None:
    ck, sc = converted
    r = cli("verify", sc, "--source", ck, "--json")
    assert r.returncode == 0, explain(r)
    assert json.loads(r.stdout)["source_checked"] is True


# --- --device without --forward ------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_device_without_forward_is_refused_with_the_fix(converted, device) -> None:
    ck, sc = converted
    r = cli("verify", sc, "--source", ck, "--device", device)
    assert r.returncode == 2, explain(r)
    assert r.stdout == ""  # refused before any check ran
    assert messages(r.stderr) == (
        f"error: --device {device} is where the forward check runs, and without --forward there "
        "is none: it would be ignored\n"
        f"  hint: add --forward to compare the model outputs on {device}, or use "
        f"--rederive-device {device} to re-derive the tensors there\n"
    )


def test_device_without_forward_in_python_uses_the_api_words(converted) -> None:
    ck, sc = converted
    with pytest.raises(UsageError, match=r"^device='cuda:0' is where .* without forward=True"):
        verify(sc, source=ck, device="cuda:0")
    assert verify(sc, source=ck).ok  # no device: nothing to refuse


# --- a typed result ------------------------------------------------------------------------------


def test_the_public_verify_returns_a_typed_result_like_convert(converted) -> None:
    ck, sc = converted
    r = mc.verify(sc, source=ck)
    assert isinstance(r, Verification) and isinstance(r, mc.Verification)
    assert r.ok and r.source_checked and r.files_checked == 4 and r.layers_checked == 4
    assert r.digest == load_manifest(sc)[1]  # as ConvertResult.digest
    assert r.seconds["total"] > 0
    assert r.report()["manifest_digest"] == r.digest and "digest" not in r.report()


def test_the_public_verify_still_raises_on_a_mismatch(converted, other) -> None:
    _, sc = converted
    with pytest.raises(VerificationError):
        mc.verify(sc, source=other)


# --- progress ------------------------------------------------------------------------------------


def test_verify_shows_progress_in_a_log_and_none_under_json_or_quiet(converted) -> None:
    ck, sc = converted
    fast = {"MPACK_PROGRESS_EVERY": "0.1"}
    r = cli("verify", sc, "--source", ck, env=fast)
    assert r.returncode == 0, explain(r)
    lines = [x for x in r.stderr.splitlines() if x.startswith("verify: ")]
    assert any(x.startswith("verify: comparing ") and x.endswith("(100%)") for x in lines), r.stderr
    assert "\r" not in r.stderr and "\x1b[" not in r.stderr  # a log gets lines, not bars
    moved = cli("verify", sc, env=fast)  # the checksums alone (the recorded source found here
    assert moved.returncode == 0, explain(moved)  # or not: either way a stage is shown)
    assert any(x.startswith("verify: ") for x in moved.stderr.splitlines()), moved.stderr
    for quiet in (["--json"], ["-q"]):
        q = cli("verify", sc, "--source", ck, *quiet, env=fast)
        assert q.returncode == 0, explain(q)
        assert q.stderr == "", q.stderr
    assert cli("verify", sc, "--source", ck, "-q").stdout == ""

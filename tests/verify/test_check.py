"""``mpack.verify.verify``, the one entry point of verification, and ``mpack.convert.verify``, the
compatible forward to it: a result that lists the problems, and the same report from both."""

from __future__ import annotations

import pytest

import mpack.convert as mc
from mpack.errors import UsageError, VerificationError
from mpack.fixtures import make_checkpoint
from mpack.sidecar import rank_file_name, read_file_map
from mpack.verify import Verification, verify
from mpack.verify.check import MAX_LISTED
from tests.conftest import flip_byte


def test_the_compatible_forward_is_callable_twice_and_agrees(converted) -> None:
    ck, sc = converted
    result = verify(sc, source=ck)
    assert result.ok and result.problems == [] and result.error() is None
    assert result.source_checked and result.tensors_compared > 0
    for _ in range(2):  # the function each time, not a submodule that replaced it
        assert callable(mc.verify)
        assert mc.verify(sc, source=ck).report() == result.report()  # a Verification too
    assert "forward" not in result.report() and result.report()["source_path"] == str(ck)


def test_problems_are_returned_and_raised_by_the_forward(converted, tmp_path) -> None:
    ck, sc = converted
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in sc.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    rank0 = bad / rank_file_name(0, 1)
    flip_byte(rank0, read_file_map(rank0).entries[0].offset)
    result = verify(bad, source=ck)  # a result, not an exception
    assert not result.ok and not result.source_checked  # no re-derivation after a bad checksum
    assert any(p.startswith(rank0.name) for p in result.problems), result.problems
    assert result.hint and "mpack convert" in result.hint
    for _ in range(2):
        with pytest.raises(VerificationError, match=r"1 problem\(s\)"):
            mc.verify(bad, source=ck)


def test_the_error_lists_the_first_problems_and_counts_the_rest() -> None:
    result = Verification("sc", "0" * 64, 1, problems=[f"p{i}" for i in range(MAX_LISTED + 5)])
    message = str(result.error())
    assert f"sc: {MAX_LISTED + 5} problem(s):" in message
    assert f"p{MAX_LISTED - 1}" in message and f"p{MAX_LISTED}\n" not in message
    assert message.endswith("... and 5 more")
    assert result.problems == [f"p{i}" for i in range(MAX_LISTED + 5)]  # not changed by error()


def test_a_revision_needs_a_source(converted) -> None:
    _, sc = converted
    with pytest.raises(UsageError, match="revision='main' applies to a given source"):
        verify(sc, revision="main")


def test_forward_without_a_source_is_a_usage_error(tmp_path) -> None:
    """The manifest records a local source that is gone: the files are checked, and then the
    forward check has nothing to compare with."""
    ck = make_checkpoint(tmp_path / "ck", arch="llama", scheme="FP8", layers=1)
    mc.convert(ck, tmp_path / "sc", device="cpu")
    ck.rename(tmp_path / "moved")
    result = verify(tmp_path / "sc")
    assert result.ok and not result.source_checked and "is not there" in result.source_note
    with pytest.raises(UsageError, match="forward=True needs the source checkpoint"):
        verify(tmp_path / "sc", forward=True)

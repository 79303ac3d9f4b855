"""The cache of good scheme-check verdicts (Note [verdict cache] in convert/scheme_check.py):
keyed by every byte the check reads and the code that judges them, never holding an error,
ignored when damaged, and in a CLI run with a hit no process imports compressed-tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mpack.convert import scheme_check
from mpack.convert.checkpoint import find_layers, layer_summary, open_checkpoint
from mpack.convert.scheme_check import SchemeCheck, cached_verdict, verdict_key
from mpack.errors import UnsupportedSchemeError
from mpack.fixtures import make_checkpoint
from tests.convert.helpers import cli, edit_config, weight_args


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("verdicts") / "ck", max_shard_size=200_000)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, in a folder of this test's own: its ``verdicts`` folder."""
    monkeypatch.setenv("MPACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MPACK_NO_VERDICT_CACHE")
    return tmp_path / "cache" / "verdicts"


def _copy(ckpt: Path, to: Path) -> Path:
    shutil.copytree(ckpt, to)
    return to


def test_the_key_follows_every_byte_the_check_reads(ckpt: Path, tmp_path: Path) -> None:
    key = verdict_key(ckpt)
    assert key is not None and len(key) == 64
    assert verdict_key(_copy(ckpt, tmp_path / "same")) == key  # the bytes, not the path
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) > 1 and (ckpt / "model.safetensors.index.json").is_file()

    seen = {key}
    cfg = _copy(ckpt, tmp_path / "cfg")
    edit_config(cfg, lambda c: c.update(mpack_test_note="x"))  # harmless to the check
    index = _copy(ckpt, tmp_path / "index")
    (index / "model.safetensors.index.json").write_text(
        json.dumps(json.loads((ckpt / "model.safetensors.index.json").read_text()), indent=1)
    )
    header = _copy(ckpt, tmp_path / "header")
    with open(header / shards[-1].name, "r+b") as f:  # one byte of the last shard's header
        f.seek(9)
        b = f.read(1)
        f.seek(9)
        f.write(bytes([b[0] ^ 0x20]))
    size = _copy(ckpt, tmp_path / "size")
    with open(size / shards[0].name, "ab") as f:
        f.write(b"\0")
    for edited in (cfg, index, header, size):
        k = verdict_key(edited)
        assert k is not None and k not in seen, edited.name
        seen.add(k)


def test_the_key_follows_the_judging_code(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = verdict_key(ckpt)
    monkeypatch.setattr(scheme_check, "VERDICT_FORMAT", scheme_check.VERDICT_FORMAT + 1)
    assert verdict_key(ckpt) != key
    monkeypatch.undo()
    monkeypatch.setattr(scheme_check, "_JUDGE_DISTS", ("compressed-tensors", "no-such-dist-x"))
    assert verdict_key(ckpt) != key


def test_unreadable_sources_have_no_key(ckpt: Path, tmp_path: Path) -> None:
    assert verdict_key(tmp_path / "missing") is None
    short = _copy(ckpt, tmp_path / "short")
    (short / sorted(ckpt.glob("*.safetensors"))[0].name).write_bytes(b"\1\2")
    assert verdict_key(short) is None


def test_a_good_verdict_is_kept_and_then_used_without_a_child(ckpt: Path, cache: Path) -> None:
    first = SchemeCheck(ckpt, background=True)
    assert first.in_child and not first.cached
    got = first.result()
    assert got == layer_summary(find_layers(open_checkpoint(ckpt, scheme=False)))
    (entry,) = cache.iterdir()
    assert entry.name == f"{verdict_key(ckpt)}.json"

    second = SchemeCheck(ckpt, background=True)
    assert second.cached and not second.in_child and second.deferred
    assert second.result() == got
    ck = open_checkpoint(ckpt, scheme=False)
    find_layers(ck)
    second.agree(ck)  # the headers' layers: they agree

    off = SchemeCheck(ckpt, background=True, use_cache=False)
    assert off.in_child and not off.cached
    off.cancel()


def test_a_cached_verdict_that_disagrees_with_the_headers_is_checked_again(
    ckpt: Path, cache: Path
) -> None:
    """agree() still compares a cached verdict with the headers' layers; where they differ (a
    damaged entry that still reads as one), the check itself runs and its verdict replaces it."""
    SchemeCheck(ckpt, background=True).result()
    (entry,) = cache.iterdir()
    good = json.loads(entry.read_text())
    module = sorted(good["layers"])[0]
    entry.write_text(
        json.dumps({**good, "layers": {**good["layers"], module: ["channel", 1, 1, True]}})
    )
    check = SchemeCheck(ckpt, background=True)
    assert check.cached
    ck = open_checkpoint(ckpt, scheme=False)
    find_layers(ck)
    check.agree(ck)
    assert not check.cached and json.loads(entry.read_text()) == good


@pytest.mark.parametrize(
    "damage", ["not json", '{"format": 1}', "[]", "key", "types"], ids=lambda d: d[:8]
)
def test_a_damaged_entry_is_ignored_and_replaced(ckpt: Path, cache: Path, damage: str) -> None:
    key = verdict_key(ckpt)
    assert key is not None
    SchemeCheck(ckpt, background=True).result()
    entry = cache / f"{key}.json"
    good = json.loads(entry.read_text())
    if damage == "key":
        text = json.dumps({**good, "key": "0" * 64})
    elif damage == "types":
        module = sorted(good["layers"])[0]
        text = json.dumps({**good, "layers": {module: ["channel", "64", 64, False]}})
    else:
        text = damage
    entry.write_text(text)
    assert cached_verdict(key) is None
    check = SchemeCheck(ckpt, background=True)
    assert check.in_child and not check.cached
    check.result()
    assert json.loads(entry.read_text()) == good  # the child's verdict replaced it


def test_a_verdict_on_changed_bytes_is_not_kept(ckpt: Path, cache: Path) -> None:
    """The child sends the key of what it judged, read after its check; a good verdict is kept
    only under the key the parent computed before it, so a source that changed in between
    leaves nothing behind (and nothing under the earlier key)."""
    check = SchemeCheck(ckpt, background=True)
    check.cancel()  # the parent's key is computed; the verdict is given by hand below
    layers = layer_summary(find_layers(open_checkpoint(ckpt, scheme=False)))
    check._settle(("ok", layers), "f" * 64)
    assert check.result() == layers
    assert not cache.exists() or not any(cache.iterdir())
    check._settle(("ok", layers), verdict_key(ckpt))
    assert cached_verdict(verdict_key(ckpt)) == layers


def test_an_error_is_never_kept(ckpt: Path, tmp_path: Path, cache: Path) -> None:
    bad = _copy(ckpt, tmp_path / "bad")
    edit_config(bad, lambda c: weight_args(c).update(strategy="group", group_size=128))
    for _ in range(2):  # the second check runs its child again: nothing was kept
        check = SchemeCheck(bad, background=True)
        assert check.in_child
        with pytest.raises(UnsupportedSchemeError, match="weight strategy 'group'"):
            check.result()
    assert not cache.exists() or not any(cache.iterdir())


def test_cli_with_a_kept_verdict_never_imports_compressed_tensors(
    ckpt: Path, tmp_path: Path
) -> None:
    """A first conversion keeps the verdict; with a compressed-tensors that cannot be imported
    on the path, a second conversion of the same bytes still succeeds (no process imported it),
    a copy with one more config key fails (its check ran), and so does a run with the cache off.
    """
    env = {"MPACK_CACHE_DIR": str(tmp_path / "cache"), "MPACK_NO_VERDICT_CACHE": "0"}
    first = cli("convert", ckpt, "-o", tmp_path / "one", "--device", "cpu", "--quiet", env=env)
    assert first.returncode == 0, first.stderr
    assert len(list((tmp_path / "cache" / "verdicts").iterdir())) == 1

    poison = tmp_path / "poison" / "compressed_tensors"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('compressed-tensors poisoned')\n")
    env["PYTHONPATH"] = str(poison.parent)
    hit = cli("convert", ckpt, "-o", tmp_path / "two", "--device", "cpu", "--quiet", env=env)
    assert hit.returncode == 0, hit.stderr
    one, two = tmp_path / "one", tmp_path / "two"
    names = sorted(str(p.relative_to(one)) for p in one.rglob("*.safetensors"))
    assert names and names == sorted(str(p.relative_to(two)) for p in two.rglob("*.safetensors"))
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name

    other = _copy(ckpt, tmp_path / "other")
    edit_config(other, lambda c: c.update(mpack_test_note="x"))
    miss = cli("convert", other, "-o", tmp_path / "three", "--device", "cpu", "--quiet", env=env)
    assert miss.returncode != 0 and not (tmp_path / "three").exists()
    assert "poisoned" in miss.stderr or "check process" in miss.stderr, miss.stderr

    env["MPACK_NO_VERDICT_CACHE"] = "1"
    off = cli("convert", ckpt, "-o", tmp_path / "four", "--device", "cpu", "--quiet", env=env)
    assert off.returncode != 0 and not (tmp_path / "four").exists()

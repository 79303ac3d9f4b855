"""``mpack push`` (mpack/hub.py): everything up to the network call, and none of it after.

No test here contacts the Hugging Face Hub. The push itself goes to a recording stand-in for
``huggingface_hub.HfApi``; where the real ``HfApi`` runs, its endpoint is a closed local port
(HF_ENDPOINT) and nothing listens there.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mpack import __version__, cli
from mpack.convert import convert
from mpack.errors import CorruptFileError, InputError, UsageError, VerificationError
from mpack.fixtures import make_checkpoint
from mpack.hub import (
    CARD_NAME,
    HubAuthError,
    HubError,
    Target,
    model_card,
    plan_push,
    push,
    push_sidecar,
    target_dir_name,
)
from mpack.sidecar import MANIFEST_NAME, load_manifest, read_file_map
from tests.conftest import flip_byte

REPO = "my-org/tiny-marlin"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


class RecordingApi:
    """Stands in for ``huggingface_hub.HfApi``: records every call, contacts nothing."""

    endpoint = "http://127.0.0.1:9"

    def __init__(self, present: list[str] | None = None, fail: BaseException | None = None):
        self.calls: list[tuple[str, tuple, dict]] = []
        self.present = present if present is not None else [".gitattributes"]
        self.fail = fail

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))
        if self.fail is not None:
            raise self.fail

    def create_repo(self, *args: Any, **kwargs: Any) -> None:
        self._call("create_repo", *args, **kwargs)

    def create_branch(self, *args: Any, **kwargs: Any) -> None:
        self._call("create_branch", *args, **kwargs)

    def list_repo_files(self, *args: Any, **kwargs: Any) -> list[str]:
        self._call("list_repo_files", *args, **kwargs)
        return list(self.present)

    def preupload_lfs_files(self, *args: Any, **kwargs: Any) -> None:
        self._call("preupload_lfs_files", *args, **kwargs)

    def create_commit(self, *args: Any, **kwargs: Any) -> Any:
        self._call("create_commit", *args, **kwargs)
        return SimpleNamespace(oid="c0ffee" * 6 + "c0ff", commit_url="https://example/commit")

    def named(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == name]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> SimpleNamespace:
    """One source, two targets converted into ``multi/<target>/`` as the multi-target convert
    lays them out (its lock files, hidden, beside them); ``single`` is the tp2 one."""
    root = tmp_path_factory.mktemp("push")
    src = make_checkpoint(
        root / "src", hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, vocab=128
    )
    multi = root / "multi"
    for tp in (1, 2):
        convert(src, multi / f"tp{tp}-w8a16-bfloat16", tp=tp, device="cpu")
    return SimpleNamespace(src=src, multi=multi, single=multi / "tp2-w8a16-bfloat16")


def _copy(d: Path, dest: Path) -> Path:
    shutil.copytree(d, dest)
    return dest


def _hub_sourced(sidecar: Path) -> dict[str, Any]:
    """The sidecar's manifest as if its source had been the Hub repo org/src at HUB_COMMIT."""
    m, _ = load_manifest(sidecar)
    m["source"] = {
        "kind": "hub",
        "repo": "org/src-FP8",
        "revision": HUB_COMMIT,
        "requested_revision": "main",
        "files": m["source"]["files"],
    }
    return m


def _front_matter(card: str) -> dict[str, Any]:
    """The card's YAML front matter, as huggingface_hub reads it (PyYAML, its dependency)."""
    from huggingface_hub import ModelCard

    assert card.startswith("---\n")
    return ModelCard(card).data.to_dict()


# --- the layout ---------------------------------------------------------------------------


def test_target_dir_name() -> None:
    t = {"tp_size": 2, "profile": "w8a16", "act_dtype": "bfloat16", "fusion": "vllm"}
    assert target_dir_name({"target": t}) == "tp2-w8a16-bfloat16"
    t8 = t | {"tp_size": 8, "profile": "w8a8-marlin", "act_dtype": "float16"}
    assert target_dir_name({"target": t8}) == "tp8-w8a8-marlin-float16"
    # checkpoint names make another target, so it gets another folder
    assert target_dir_name({"target": t | {"fusion": "none"}}) == "tp2-w8a16-bfloat16-fuse-none"


def test_one_sidecar_goes_to_the_root_with_its_card(converted) -> None:
    sc = converted.single
    plan = plan_push(sc, REPO)
    m, digest = load_manifest(sc)
    names = sorted([f["name"] for f in m["files"]] + [MANIFEST_NAME, CARD_NAME])
    assert [u.path_in_repo for u in plan.uploads] == names
    for u in plan.uploads:
        if u.path_in_repo == CARD_NAME:
            assert u.local is None and u.size == len(plan.card.encode())
        else:
            assert u.local == sc / u.path_in_repo
            assert u.size == os.stat(sc / u.path_in_repo).st_size
    assert plan.total_bytes == sum(u.size for u in plan.uploads)
    assert [(t.folder, t.digest) for t in plan.targets] == [("", digest)]
    doc = plan.report()
    assert doc["bytes"] == plan.total_bytes and doc["card"] == plan.card
    assert {f["path"]: f["size"] for f in doc["files"]} == {
        u.path_in_repo: u.size for u in plan.uploads
    }


def test_several_targets_go_to_one_folder_each(converted) -> None:
    plan = plan_push(converted.multi, REPO)
    assert [t.folder for t in plan.targets] == ["tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16"]
    paths = {u.path_in_repo: u for u in plan.uploads}
    for t in plan.targets:
        m, _ = load_manifest(t.sidecar)
        for name in [f["name"] for f in m["files"]] + [MANIFEST_NAME]:
            assert paths[f"{t.folder}/{name}"].local == t.sidecar / name
    # the root: the card and the model's own files (vLLM reads config and tokenizer there),
    # no weights
    root = sorted(p for p in paths if "/" not in p)
    assert root == [CARD_NAME, "config.json", "generation_config.json"]
    assert paths["config.json"].local.read_bytes() == (converted.src / "config.json").read_bytes()
    # one card, every target, the planned syntax for a sidecar in a folder
    card = plan.card
    assert (
        "vllm serve my-org/tiny-marlin --load-format mpack --model-loader-extra-config "
        """'{"sidecar": "my-org/tiny-marlin/tp1-w8a16-bfloat16"}'""" in card
    )
    assert (
        "vllm serve my-org/tiny-marlin --load-format mpack --tensor-parallel-size 2 "
        """--model-loader-extra-config '{"sidecar": "my-org/tiny-marlin/tp2-w8a16-bfloat16"}'"""
        in card
    )
    assert "mpack serve my-org/tiny-marlin/tp2-w8a16-bfloat16 --rank 1 --device cuda:1 &" in card
    for t in plan.targets:
        assert f"### {t.folder}" in card and t.digest in card


def test_hidden_entries_and_plain_files_beside_targets_are_left_out(converted, tmp_path) -> None:
    multi = _copy(converted.multi, tmp_path / "multi")
    (multi / ".cache").mkdir()  # hidden, and not a conversion's (those refuse the push:
    (multi / "notes.txt").write_text("x")  # tests/hostile/test_push_hostile.py)
    plan = plan_push(multi, REPO)
    assert plan.skipped == ["notes.txt"]
    assert not any(".cache" in u.path_in_repo or "notes" in u.path_in_repo for u in plan.uploads)


# --- the card -----------------------------------------------------------------------------


def test_card_of_a_hub_sourced_sidecar(converted) -> None:
    sc = converted.single
    _, digest = load_manifest(sc)
    t = Target(sc, "", _hub_sourced(sc), digest)
    card = model_card(REPO, [t])
    front = _front_matter(card)
    assert front["base_model"] == "org/src-FP8"
    assert front["base_model_relation"] == "quantized"
    assert front["library_name"] == "vllm"
    assert front["pipeline_tag"] == "text-generation"
    assert front["tags"] == ["mpack", "marlin", "fp8", "compressed-tensors", "vllm"]
    assert "`org/src-FP8` (Hugging Face Hub)" in card
    assert f"| source commit | `{HUB_COMMIT}` (asked for: main) |" in card
    assert f"| converted with | mpack {__version__} |" in card
    assert "| the repo root | 0.33.0 | w8a16 | 2 | bfloat16 |" in card
    assert f"`{digest}`" in card
    install, commands = (b.split("```")[0].splitlines() for b in card.split("```sh\n")[1:3])
    assert install == [f"pip install 'mpack-marlin[vllm]=={__version__}'"]
    assert commands == [
        "mpack serve my-org/tiny-marlin --rank 0 --device cuda:0 &",
        "mpack serve my-org/tiny-marlin --rank 1 --device cuda:1 &",
        "vllm serve my-org/tiny-marlin --load-format mpack --tensor-parallel-size 2",
    ]
    assert "mpack verify my-org/tiny-marlin --source org/src-FP8" in card


def test_card_of_a_local_source_has_no_base_model(converted) -> None:
    plan = plan_push(converted.single, REPO)
    front = _front_matter(plan.card)
    assert "base_model" not in front and front["library_name"] == "vllm"
    assert "a local directory, src, on the machine" in plan.card and "not a Hub repo" in plan.card
    assert str(converted.src.parent) not in plan.card  # its name only: Note [source path]


def test_card_commands_name_the_branch_and_the_dtype(converted) -> None:
    sc = converted.single
    m, digest = load_manifest(sc)
    m["target"]["act_dtype"] = "float16"  # the checkpoint is bfloat16: vLLM must be told
    card = model_card(REPO, [Target(sc, "", m, digest)], revision="tp2")
    assert "mpack serve my-org/tiny-marlin@tp2 --rank 0 --device cuda:0 &" in card
    assert (
        "vllm serve my-org/tiny-marlin --load-format mpack --revision tp2 "
        "--tensor-parallel-size 2 --dtype float16"
    ) in card


# --- refusals, before any network call ----------------------------------------------------


def test_a_checkpoint_is_not_a_sidecar(converted) -> None:
    api = RecordingApi()
    with pytest.raises(InputError, match="no mpack.json") as e:
        push_sidecar(converted.src, REPO, api=api)
    assert e.value.exit_code == 2 and str(converted.src) in str(e.value)
    assert api.calls == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "extra"])
def test_a_damaged_sidecar_is_refused(converted, tmp_path, damage) -> None:
    sc = _copy(converted.single, tmp_path / "sc")
    rank1 = sc / "rank-01-of-02.safetensors"
    if damage == "flip":
        flip_byte(rank1, read_file_map(rank1).entries[0].offset)
    elif damage == "truncate":
        os.truncate(rank1, rank1.stat().st_size - 64)
    else:
        (sc / "README.md").write_text("not listed in the manifest")
    api = RecordingApi()
    with pytest.raises(VerificationError) as e:
        push_sidecar(sc, REPO, api=api)
    named = "README.md" if damage == "extra" else "rank-01-of-02.safetensors"
    assert e.value.exit_code == 2 and named in str(e.value) and "nothing pushed" in str(e.value)
    assert api.calls == []


def test_a_malformed_manifest_is_refused(converted, tmp_path) -> None:
    sc = _copy(converted.single, tmp_path / "sc")
    (sc / MANIFEST_NAME).write_text("{not json")
    api = RecordingApi()
    with pytest.raises(CorruptFileError, match="mpack.json"):
        push_sidecar(sc, REPO, api=api)
    assert api.calls == []


def test_a_damaged_target_stops_the_whole_push(converted, tmp_path) -> None:
    multi = _copy(converted.multi, tmp_path / "multi")
    rank0 = multi / "tp1-w8a16-bfloat16" / "rank-00-of-01.safetensors"
    flip_byte(rank0, rank0.stat().st_size - 1)
    api = RecordingApi()
    with pytest.raises(VerificationError, match="tp1-w8a16-bfloat16"):
        push_sidecar(multi, REPO, api=api)
    assert api.calls == []


def test_a_folder_that_is_not_a_sidecar_beside_the_targets(converted, tmp_path) -> None:
    multi = _copy(converted.multi, tmp_path / "multi")
    (multi / "junk").mkdir()
    with pytest.raises(InputError, match="junk: no mpack.json"):
        plan_push(multi, REPO)


def test_two_sidecars_of_one_target(converted, tmp_path) -> None:
    multi = _copy(converted.multi, tmp_path / "multi")
    shutil.copytree(multi / "tp2-w8a16-bfloat16", multi / "again")
    with pytest.raises(InputError, match="both are target tp2-w8a16-bfloat16"):
        plan_push(multi, REPO)


@pytest.mark.parametrize("repo_id", ["tiny-marlin", "a/b/c", "org/", "../x", "org/a..b", ""])
def test_a_repo_id_needs_namespace_and_name(converted, repo_id) -> None:
    with pytest.raises(UsageError):
        plan_push(converted.single, repo_id)


# --- the push (to a stand-in) -------------------------------------------------------------


def test_the_push_is_one_commit_of_the_planned_files(converted) -> None:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    plan = plan_push(converted.single, REPO, private=True)
    stale = ["rank-02-of-04.safetensors", "old/x.json"]
    api = RecordingApi(present=[".gitattributes", CARD_NAME, *stale])
    result = push(plan, api=api)
    assert [n for n, _, _ in api.calls] == ["create_repo", "list_repo_files", "create_commit"]
    ((args, kwargs),) = api.named("create_repo")
    assert args == (REPO,) and kwargs["private"] is True and kwargs["exist_ok"] is True
    ((args, kwargs),) = api.named("create_commit")
    assert args[0] == REPO and kwargs["revision"] is None
    ops = list(args[1])
    adds = [o for o in ops if isinstance(o, CommitOperationAdd)]
    assert [o.path_in_repo for o in adds] == [u.path_in_repo for u in plan.uploads]
    for o, u in zip(adds, plan.uploads, strict=True):
        want = plan.card.encode() if u.local is None else str(u.local)
        assert o.path_or_fileobj == want
    # what an earlier push left and this one does not send goes; .gitattributes stays
    deletes = [o.path_in_repo for o in ops if isinstance(o, CommitOperationDelete)]
    assert deletes == sorted(stale) == result.deleted
    assert result.commit and result.url == "https://example/commit"


def test_a_branch_is_created_and_committed_to(converted) -> None:
    plan = plan_push(converted.multi, REPO, revision="tp-sweep")
    api = RecordingApi()
    push(plan, api=api)
    assert [n for n, _, _ in api.calls] == [
        "create_repo",
        "create_branch",
        "list_repo_files",
        "preupload_lfs_files",  # the bytes two targets share, once: Note [shared uploads]
        "create_commit",
    ]
    assert api.named("preupload_lfs_files")[0][1]["revision"] == "tp-sweep"
    assert api.named("create_branch")[0][1]["branch"] == "tp-sweep"
    assert api.named("create_branch")[0][1]["exist_ok"] is True
    assert api.named("list_repo_files")[0][1]["revision"] == "tp-sweep"
    assert api.named("create_commit")[0][1]["revision"] == "tp-sweep"


def test_a_file_replaced_after_the_checks_is_not_sent(converted, tmp_path) -> None:
    sc = _copy(converted.single, tmp_path / "sc")
    plan = plan_push(sc, REPO)
    rank0 = sc / "rank-00-of-02.safetensors"
    data = rank0.read_bytes()
    rank0.unlink()
    rank0.write_bytes(data)  # same bytes, another file: it was not the one checked
    api = RecordingApi()
    with pytest.raises(InputError, match="changed after it was checked"):
        push(plan, api=api)
    assert api.named("create_commit") == []


def test_hub_errors_become_mpack_errors(converted) -> None:
    from huggingface_hub import errors as hf

    plan = plan_push(converted.single, REPO)
    with pytest.raises(HubAuthError) as e:
        push(plan, api=RecordingApi(fail=hf.LocalTokenNotFoundError("no token")))
    assert e.value.exit_code == 3 and "hf auth login" in e.value.hint
    http = sys.modules[hf.HTTPError.__module__]  # httpx (or requests) as huggingface_hub uses it
    if not hasattr(http, "Request"):
        pytest.skip("this huggingface_hub's HTTP errors are not httpx's")
    response = http.Response(403, request=http.Request("POST", "http://127.0.0.1:9/api"))
    with pytest.raises(HubAuthError, match="HTTP 403") as e:
        push(plan, api=RecordingApi(fail=hf.HfHubHTTPError("forbidden", response=response)))
    assert e.value.exit_code == 3
    response = http.Response(400, request=http.Request("POST", "http://127.0.0.1:9/api"))
    with pytest.raises(InputError, match="HTTP 400") as e:
        push(plan, api=RecordingApi(fail=hf.BadRequestError("bad card", response=response)))
    assert e.value.exit_code == 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_the_real_hfapi_to_a_closed_port_is_an_environment_error(converted) -> None:
    from huggingface_hub import HfApi

    plan = plan_push(converted.single, REPO)
    api = HfApi(endpoint=f"http://127.0.0.1:{_closed_port()}", token="hf_not_a_token")
    with pytest.raises(HubError, match="cannot reach") as e:
        push(plan, api=api)
    assert e.value.exit_code == 3


# --- the command line ---------------------------------------------------------------------


def _env_without_hub() -> dict[str, str]:
    """A child's environment where any Hub call would fail at once and locally."""
    return os.environ | {
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "HF_HUB_OFFLINE": "1",
        "HF_TOKEN": "hf_not_a_token",
    }


def test_dry_run_json_makes_no_network_call(converted) -> None:
    # The card is huggingface_hub's ModelCard, whose module imports the HTTP client: what a dry
    # run must not do is open a connection or resolve a name (an audit hook sees every one).
    code = (
        "import sys\n"
        "def hook(event, args):\n"
        "    if event in ('socket.connect', 'socket.getaddrinfo', 'socket.bind'):\n"
        "        raise RuntimeError(f'network call during a dry run: {event} {args}')\n"
        "sys.addaudithook(hook)\n"
        "from mpack import cli\n"
        f"code = cli.main(['push', {str(converted.multi)!r}, {REPO!r}, '--dry-run', '--json'])\n"
        "sys.exit(code)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env_without_hub(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    plan = plan_push(converted.multi, REPO)
    assert doc["ok"] is True and doc["dry_run"] is True
    assert doc["files"] == plan.report()["files"] and doc["bytes"] == plan.total_bytes
    assert doc["card"] == plan.card
    assert [t["folder"] for t in doc["targets"]] == ["tp1-w8a16-bfloat16", "tp2-w8a16-bfloat16"]


def test_dry_run_text_lists_files_total_and_card(converted, capsys) -> None:
    assert cli.main(["push", str(converted.single), REPO, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{REPO}: 1 target, 7 files, ")
    assert "rank-01-of-02.safetensors" in out and "(model card)" in out
    assert "dry run: nothing was sent" in out and "library_name: vllm" in out


@pytest.mark.parametrize(
    ("what", "code", "said"),
    [("corrupt", 2, "rank-00-of-02.safetensors"), ("good", 3, "HF_HUB_OFFLINE")],
)
def test_cli_exit_codes(converted, tmp_path, what, code, said) -> None:
    sc = _copy(converted.single, tmp_path / "sc")
    if what == "corrupt":
        flip_byte(sc / "rank-00-of-02.safetensors", 100)
    r = subprocess.run(
        [sys.executable, "-m", "mpack", "push", str(sc), REPO, "--json"],
        capture_output=True,
        text=True,
        env=_env_without_hub(),
        timeout=120,
    )
    assert r.returncode == code, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and said in doc["error"]["message"]


def test_convert_push_refuses_json_before_converting(converted, tmp_path) -> None:
    out = tmp_path / "out"
    args = ["convert", str(converted.src), "-o", str(out), "--json", "--push", REPO]
    assert cli.main(args) == 2
    assert cli.main(["convert", str(converted.src), "-o", str(out), "--push", "no-namespace"]) == 2
    assert not out.exists()


def test_convert_push_pushes_the_finished_sidecar(converted, tmp_path, monkeypatch) -> None:
    import mpack.hub

    sent = []

    def recording_push(plan, **kwargs):
        sent.append(plan)
        return mpack.hub.PushResult(plan, "abc", None)

    monkeypatch.setattr(mpack.hub, "push", recording_push)
    out = tmp_path / "out"
    args = ["convert", str(converted.src), "-o", str(out), "--device", "cpu", "--push", REPO]
    assert cli.main(args) == 0
    (plan,) = sent
    assert plan.repo_id == REPO and [t.sidecar for t in plan.targets] == [out.resolve()]
    assert plan.targets[0].digest == load_manifest(out)[1]

"""The vLLM loader's inputs (issue 24, items 1 and 8): ``--load-format mpack`` must refuse a
sidecar that covers only part of the model, and bad extra config or malformed sidecars with an
``MpackError`` naming the key or file, before vLLM builds any layer where the fact is known.

Runs in .venv-vllm (``make test`` runs it there; the main venv skips it). Real checkpoints and
sidecars from the main venv's CLI, edited the way a hostile or careless user would, then
re-signed (the manifest's sizes and digests recomputed) so that only the loader's own checks
stand between them and the engine. Every load runs in one ``tests/vllm/vllm_worker.py`` process:
vLLM 0.33.0's real classes on the CPU (tests/vllm/cpu_standins.py), the 2-layer Llama of
tests/vllm (per-tensor scales, ``w8a16``, bfloat16, TP 1), private loads (``attach: never``).
``linear_layers_built`` counts vLLM linear layers built before the error: 0 means the load was
refused before any model memory was allocated.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

# Only a real vLLM counts, not a folder named vllm found on sys.path (tests/conftest.py).
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin in (None, "namespace"):
    pytest.skip("needs vLLM: make test runs this file with .venv-vllm", allow_module_level=True)
pytest.importorskip("vllm")

from mpack.errors import MpackError, UsageError  # noqa: E402
from mpack.iokit import chunk_digests, sha256_file  # noqa: E402
from mpack.runtime.vllm.checks import Options  # noqa: E402
from mpack.sidecar import (  # noqa: E402
    COMMON_NAME,
    FileMap,
    HashingWriter,
    TensorSpec,
    load_manifest,
    read_file_map,
    write_manifest,
)
from tests.vllm.test_vllm_loader import assert_same_tensors, ok, run_cli, run_workers  # noqa: E402

CKPT = ["--arch", "llama", "--scheme", "FP8", "--dtype", "bfloat16"]  # 2 layers, vocab 1000
CONVERT = ["--tp", "1", "--profile", "w8a16", "--act-dtype", "bfloat16", "--quiet"]
RANK = "rank-00-of-01.safetensors"


# --- making hostile sidecars ---------------------------------------------------------------------


def resign(sidecar: Path, manifest: dict[str, Any] | None = None) -> None:
    """Write ``manifest`` (default: the sidecar's own) with every file's size and digests
    recomputed from the bytes on disk: the sidecar passes every integrity check as it is."""
    if manifest is None:
        manifest, _ = load_manifest(sidecar)
    for f in manifest["files"]:
        path = sidecar / f["name"]
        f["size"] = path.stat().st_size
        if "sha256" in f:
            f["sha256"] = sha256_file(path)
        if "chunks" in f:
            f["chunks"]["sha256"] = chunk_digests(path, f["chunks"]["bytes"])
    write_manifest(sidecar, manifest)


def rewrite(path: Path, keep: Any = lambda name: True, add: TensorSpec | None = None) -> None:
    """Rewrite safetensors file ``path`` with only the tensors ``keep(name)`` accepts (their
    bytes unchanged), and ``add`` (zeros), laid out as mpack lays out its files."""
    old = read_file_map(path)
    kept = [e for e in old.entries if keep(e.name)]
    specs = [TensorSpec(e.name, e.dtype, e.shape) for e in kept] + ([add] if add else [])
    file_map = FileMap.plan(specs, old.metadata)
    data = path.read_bytes()
    tmp = path.with_suffix(".tmp")
    w = HashingWriter(tmp, file_map)
    for e in kept:
        new = file_map.entry(e.name)
        w.write_at(new.offset, data[e.offset : e.offset + e.nbytes])
    if add:
        w.write_at(file_map.entry(add.name).offset, bytes(add.nbytes))
    w.finish()
    os.replace(tmp, path)


def edited(base: Path, dest: Path, edit: Any) -> Path:
    """A copy of sidecar ``base`` at ``dest``, its manifest passed through ``edit(manifest,
    dest)`` and re-signed."""
    shutil.copytree(base, dest)
    manifest, _ = load_manifest(dest)
    edit(manifest, dest)
    resign(dest, manifest)
    return dest


def set_config(value: Any) -> Any:
    def edit(m: dict[str, Any], _: Path) -> None:
        m["model"]["config"] = value

    return edit


def set_shards(layer: str, value: Any) -> Any:
    def edit(m: dict[str, Any], _: Path) -> None:
        m["layers"][layer]["shards"] = value

    return edit


def no_layers(m: dict[str, Any], dest: Path) -> None:
    """``layers: {}`` and a rank file with no tensors: schema-valid, and it used to load."""
    m["layers"] = {}
    rewrite(dest / RANK, keep=lambda name: False)


def drop(tensor: str) -> Any:
    def edit(m: dict[str, Any], dest: Path) -> None:
        rewrite(dest / COMMON_NAME, keep=lambda name: name != tensor)

    return edit


def add_tensor(spec: TensorSpec) -> Any:
    def edit(m: dict[str, Any], dest: Path) -> None:
        rewrite(dest / COMMON_NAME, add=spec)

    return edit


def bias_for(layer: str) -> Any:
    """``layer`` of the rank file gets a bias (zeros) that the model's layer does not have."""

    def edit(m: dict[str, Any], dest: Path) -> None:
        m["layers"][layer]["bias"] = True
        spec = TensorSpec(f"{layer}.bias", "BF16", (m["layers"][layer]["np"],))
        rewrite(dest / RANK, add=spec)

    return edit


def common_of(other: Path) -> Any:
    def edit(m: dict[str, Any], dest: Path) -> None:
        shutil.copyfile(other / COMMON_NAME, dest / COMMON_NAME)

    return edit


QKV0 = "model.layers.0.self_attn.qkv_proj"
Q_NORM = "model.layers.1.self_attn.q_norm.weight"
EXTRA = "model.layers.0.mlp.extra.weight"

# What each bad load is, what its error must say (a regex, and strings it must hold), and
# whether it must be refused before vLLM builds any layer (unless "after"). Each is loaded into
# the 2-layer Llama (Qwen3 where its name says so); each sidecar is made in the `world` fixture.
BAD: dict[str, dict[str, Any]] = {
    # Item 1: a sidecar that covers only part of the model.
    "1-layer-config-reduced": dict(about=r"model\.config", needs=("mpack.json", "hidden_size")),
    "1-layer-config-forged": dict(
        about=r"no weights for layer", needs=("model.layers.1", "mpack.json")
    ),
    "layers-empty": dict(about=r"lists no layers", needs=("mpack.json",)),
    "config-missing-vocab": dict(about=r"model\.config has no vocab_size", needs=("1000",)),
    "common-without-norm": dict(about=r"has no model\.norm\.weight", needs=(COMMON_NAME,)),
    # Known only once vLLM has built the model: Qwen3's q/k norms are the architecture's own.
    "qwen3-common-without-q-norm": dict(
        about=r"no tensor for 1 parameter", needs=(Q_NORM, COMMON_NAME), after=True
    ),
    # vLLM refuses it deep in its own loader, after the build: an mpack error naming the file.
    "common-unknown-tensor": dict(
        about=r"vLLM could not load it into this model at tensor " + re.escape(EXTRA),
        needs=(COMMON_NAME, "ValueError"),
        after=True,
    ),
    # A Marlin layer's parameters are exactly the sidecar's: no bias the model does not have.
    "bias-the-model-lacks": dict(
        about=r"layer model\.layers\.0\.self_attn\.o_proj has parameters weight, weight_scale",
        needs=("bias",),
        after=True,
    ),
    # Item 8: bad extra config and malformed sidecars.
    "extra-sidecar-int": dict(about=r"sidecar is 5, not a path", needs=("extra-config",)),
    "extra-socket-int": dict(about=r"socket is 5, not a path", needs=("extra-config",)),
    "config-list": dict(about=r"model\.config", needs=("mpack.json",)),
    "shards-int": dict(about=r"shards is 5", needs=(QKV0, "mpack.json")),
    "shards-no-module": dict(about=r"shards is \[\{'rows'", needs=(QKV0,)),
    "shards-strings": dict(about=r"shards is \['x'\]", needs=(QKV0,)),
    "shards-other-modules": dict(about=r"shards is", needs=(QKV0, "q_proj, ")),
    "common-other-vocab": dict(
        about=r"(embed_tokens|lm_head)\.weight is \[1024, 256\]", needs=(COMMON_NAME, "[1000")
    ),
    # A multi-target directory without the engine's target (TP 1): the folder looked for, and
    # the targets it has (it said only "no mpack.json").
    "targets-without-the-engines": dict(
        about=r"not an mpack sidecar \(no mpack\.json, nor a folder tp1-w8a16-bfloat16 "
        r"\(the engine's target\) holding one; it holds the targets tp2-w8a16-bfloat16, "
        r"tp2-w8a8-marlin-bfloat16\)",
        needs=("--tp 1 --profile w8a16 --act-dtype bfloat16",),
    ),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-hostile")
    ckpts = {
        "ck": [],
        "ck-1layer": ["--layers", "1"],
        "ck-vocab": ["--vocab", "1024"],
        "ck-tied": ["--tie-embeddings"],
        "ck-qwen3": ["--arch", "qwen3"],
    }
    for name, more in ckpts.items():
        run_cli(["mpack.fixtures", str(work / name), *CKPT, *more], work)
    ck, ckt, ckq = work / "ck", work / "ck-tied", work / "ck-qwen3"
    sc, sc1, scv, scn = work / "sc", work / "sc-1layer", work / "sc-vocab", work / "sc-np"
    sct, scq = work / "sc-tied", work / "sc-qwen3"
    for src, out, more in (
        (ck, sc, []),
        (work / "ck-1layer", sc1, []),
        (work / "ck-vocab", scv, []),
        (ck, scn, ["--no-passthrough"]),
        (ckt, sct, []),
        (ckq, scq, []),
    ):
        run_cli(["mpack", "convert", str(src), "-o", str(out), *CONVERT, *more], work)
    targets = work / "targets"  # tp2-w8a16-bfloat16/, tp2-w8a8-marlin-bfloat16/: no TP 1
    more = ["--tp", "2", "--profile", "w8a16,w8a8-marlin", "--act-dtype", "bfloat16", "--quiet"]
    run_cli(["mpack", "convert", str(ck), "-o", str(targets), *more], work)

    full_config = load_manifest(sc)[0]["model"]["config"]
    no_vocab = {k: v for k, v in full_config.items() if k != "vocab_size"}
    qkv0_shards = load_manifest(scn)[0]["layers"][QKV0]["shards"]
    bad = {
        "1-layer-config-reduced": (sc1, set_config({"dtype": "bfloat16"})),
        "1-layer-config-forged": (sc1, set_config(full_config)),
        "layers-empty": (sc, no_layers),
        "config-missing-vocab": (sc, set_config(no_vocab)),
        "common-without-norm": (sc, drop("model.norm.weight")),
        "qwen3-common-without-q-norm": (scq, drop(Q_NORM)),
        "common-unknown-tensor": (sc, add_tensor(TensorSpec(EXTRA, "BF16", (256,)))),
        "bias-the-model-lacks": (sc, bias_for("model.layers.0.self_attn.o_proj")),
        "config-list": (sc, set_config([["hidden_size", 256]])),
        "shards-int": (scn, set_shards(QKV0, 5)),
        "shards-no-module": (scn, set_shards(QKV0, [{"rows": 256}])),
        "shards-strings": (scn, set_shards(QKV0, ["x"])),
        "shards-other-modules": (scn, set_shards(QKV0, qkv0_shards[:2])),
        "common-other-vocab": (sc, common_of(scv)),
    }
    paths = {name: edited(base, work / f"sc-{name}", edit) for name, (base, edit) in bad.items()}

    def load(id: str, sidecar: Path | None, **kw: Any) -> dict[str, Any]:
        model = ckq if id.startswith("qwen3") else ck
        d = {"id": id, "model": str(model), "profile": "w8a16", "dtype": "bfloat16"}
        if sidecar is not None:
            d.update(
                load_format="mpack",
                sidecar=str(sidecar),
                extra={"sidecar": str(sidecar), "attach": "never"},
            )
        return d | kw

    loads = [
        load("default", None),
        load("good", sc),
        load("good-no-passthrough", scn),
        load("default-tied", None, model=str(ckt)),
        load("good-tied", sct, model=str(ckt)),
        load("qwen3-default", None),
        load("qwen3-good", scq),
        load("extra-sidecar-int", sc, extra={"sidecar": 5}),
        load("extra-socket-int", sc, extra={"sidecar": str(sc), "socket": 5}),
        load("targets-without-the-engines", targets),
    ]
    # A 1-layer model's sidecar beside the 2-layer checkpoint: the binding check (the
    # other-checkpoint cases of tests/vllm/test_vllm_loader.py) turned off, to reach the
    # checks of the manifest behind it.
    unbound = {"check_source": False}
    loads += [
        load(name, path)
        if not name.startswith("1-layer-")
        else load(name, path, extra={"sidecar": str(path), "attach": "never", **unbound})
        for name, path in paths.items()
    ]
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(work),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    results = run_workers({1: loads}, env, work)[1][0]
    return {"results": results, "paths": paths}


@pytest.mark.slow
@pytest.mark.parametrize(
    "load, default",
    [
        ("good", "default"),
        ("good-no-passthrough", "default"),
        ("good-tied", "default-tied"),
        ("qwen3-good", "qwen3-default"),
    ],
)
def test_honest_sidecars_still_load(world: dict[str, Any], load: str, default: str) -> None:
    """The checks refuse nothing an honest conversion writes (lm_head tied or not, Qwen3's own
    norms, --no-passthrough): the model equals vLLM's own."""
    res = world["results"]
    assert_same_tensors(ok(res[load])["tensors"], ok(res[default])["tensors"], load)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD))
def test_hostile_input_is_an_mpack_error(world: dict[str, Any], name: str) -> None:
    bad, r = BAD[name], world["results"][name]
    assert not r["ok"], f"{name}: the sidecar loaded"
    err = r["error"]
    assert "MpackError" in err["mro"], f"{name}: not an mpack error: {err}\n{r['traceback']}"
    assert re.search(bad["about"], err["message"]), f"{name}: {err['message']!r}"
    for s in bad["needs"]:
        assert s in err["message"] + str(err["hint"]), f"{name}: {s!r} not in {err['message']!r}"
    if bad.get("after"):  # known only once vLLM has loaded what it could
        assert err["linear_layers_built"] > 0, err
    else:
        assert err["linear_layers_built"] == 0, (
            f"{name}: refused only after {err['linear_layers_built']} linear layers were "
            f"built: {err['message']}"
        )


# --- --model-loader-extra-config, without an engine -----------------------------------------------


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"sidecar": 5}, "sidecar"),
        ({"socket": 5}, "socket"),
        ({"sidecar": ["/a"]}, "sidecar"),
        ({"sidecar": ""}, "sidecar"),
        ({"socket": "/run/x\0y"}, "socket"),
        ({"attach": ["auto"]}, "attach"),
        ({"attach": {"auto": 1}}, "attach"),
        ({"attach": 5}, "attach"),
        ({5: "x"}, "unknown key"),
        ([["sidecar", "/a"]], "not a JSON object"),
        ("sidecar=/a", "not a JSON object"),
    ],
)
def test_bad_extra_config_is_a_usage_error(extra: Any, key: str) -> None:
    with pytest.raises(MpackError) as e:
        Options.parse(extra)
    assert isinstance(e.value, UsageError) and e.value.exit_code == 2, repr(e.value)
    assert "--model-loader-extra-config" in e.value.message and key in e.value.message
    assert e.value.hint


def test_good_extra_config_parses() -> None:
    assert Options.parse(None) == Options()
    assert Options.parse({"sidecar": "/m", "attach": "never", "socket": "/s"}) == Options(
        "/m", "never", "/s"
    )


def test_a_long_hostile_value_is_capped_and_escaped() -> None:
    with pytest.raises(UsageError) as e:
        Options.parse({"attach": "\x1b[31m" + "a" * 100_000})
    assert "\x1b" not in e.value.message and len(e.value.message) < 400, e.value.message[:400]

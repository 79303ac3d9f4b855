"""``--load-format mpack`` at pipeline-parallel size 2, on CPU in vLLM 0.33.0's real classes.

A sidecar has one file per TP rank; each pipeline stage takes the layers vLLM gives it (Note [a
layer range per stage] in docs/FORMAT.md). Here two stages, and TP 1 and TP 2 within them, are
stood in as the TP suite stands in TP (test_vllm_loader.py): one ``vllm_worker.py`` process per
rank over gloo, vLLM's own ``initialize_model_parallel(tp, pp)`` making rank ``r`` TP rank
``r % tp`` of stage ``r // tp``. In each stage, every parameter and buffer of the mpack loader's
model (loaded privately, and attached to ``mpack serve --device cpu``) equals vLLM's own
``DefaultModelLoader`` load of that stage: the same layers built (``PPMissingLayer`` elsewhere),
the embeddings on the first stage, the final norm and lm_head on the last, and a tied lm_head's
embeddings there too (vLLM 0.33.0's Llama builds ``embed_tokens`` on the last stage when the
embeddings are tied). mpack's copy of vLLM's layer split (:func:`mpack.arch.pp_layers`) is
compared with vLLM's ``get_pp_indices``, ``VLLM_PP_LAYER_PARTITION`` included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mpack import arch
from mpack.errors import UsageError
from tests.vllm.test_vllm_loader import assert_same_tensors, ok, run_cli, serve_and_run

PP = 2
#: Private; attached to the daemon of the whole rank; attached to the daemon of the stage
#: (``serve --pp-rank``, in a runtime directory of its own).
PATHS = ("mpack-never", "mpack-require", "mpack-stage")
#: A split of 3 layers other than vLLM's own [2, 1], set for one pair of loads.
PARTITION = "1,2"


@dataclass(frozen=True)
class Case:
    name: str
    fixture: tuple[str, ...]  # python -m mpack.fixtures arguments
    tp: int
    profile: str
    dtype: str
    layers: int


CASES = [
    # 3 layers over 2 stages: vLLM's uneven split, [2, 1]
    Case(
        "llama-tensor-w8a16-bf16-tp1",
        ("--arch", "llama", "--scheme", "FP8", "--dtype", "bfloat16", "--layers", "3"),
        1,
        "w8a16",
        "bfloat16",
        3,
    ),
    # tied embeddings: the last stage builds embed_tokens for its lm_head
    Case(
        "llama-channel-tied-w8a8-fp16-tp1",
        (
            *("--arch", "llama", "--scheme", "FP8_DYNAMIC", "--dtype", "float16"),
            *("--tie-embeddings", "--layers", "4", "--vocab", "1024"),
        ),
        1,
        "w8a8-marlin",
        "float16",
        4,
    ),
    # q/k/v bias, TP 2 within each stage: 4 processes
    Case(
        "qwen2-channel-w8a16-bf16-tp2",
        ("--arch", "qwen2", "--scheme", "FP8_DYNAMIC", "--dtype", "bfloat16", "--layers", "3"),
        2,
        "w8a16",
        "bfloat16",
        3,
    ),
]
CASE_IDS = [c.name for c in CASES]
SPLIT = CASES[0]  # the case loaded again with VLLM_PP_LAYER_PARTITION=PARTITION


def _loads(case: Case, ckpt: Path, sidecar: Path, stages: Path) -> list[dict[str, Any]]:
    base = {"model": str(ckpt), "profile": case.profile, "dtype": case.dtype}
    mpack = dict(base, load_format="mpack", sidecar=str(sidecar))
    out = [dict(base, id=f"{case.name}/default")]
    out += [
        dict(mpack, id=f"{case.name}/{p}", extra={"sidecar": str(sidecar), "attach": p[6:]})
        for p in PATHS[:2]
    ]
    at_stages = {"XDG_RUNTIME_DIR": str(stages)}
    out.append(
        dict(
            mpack,
            id=f"{case.name}/mpack-stage",
            extra={"sidecar": str(sidecar), "attach": "require"},
            env=at_stages,
        )
    )
    if case is SPLIT:
        split = {"VLLM_PP_LAYER_PARTITION": PARTITION}
        # the stage daemons serve vLLM's default split, [2, 1]: refused, attach auto or not
        out += [
            dict(
                mpack,
                id=f"{case.name}/split-stage-{mode}",
                extra={"sidecar": str(sidecar), "attach": mode},
                env={**at_stages, **split},
            )
            for mode in ("auto", "require")
        ]
        out += [
            dict(base, id=f"{case.name}/split-default", env=split),
            dict(
                mpack,
                id=f"{case.name}/split-mpack",
                extra={"sidecar": str(sidecar), "attach": "never"},
                env=split,
            ),
        ]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[int, dict]]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.fail("no vLLM here: run these tests with .venv-vllm (make test)")
    work = tmp_path_factory.mktemp("vllm-pp")
    runtime, stages = work / "xdg-runtime", work / "xdg-runtime-stages"
    runtime.mkdir(mode=0o700)
    stages.mkdir(mode=0o700)
    sidecars = {}
    by_tp: dict[int, list[dict[str, Any]]] = {}
    for c in CASES:
        ckpt, sidecars[c.name] = work / f"ck-{c.name}", work / f"sc-{c.name}"
        run_cli(["mpack.fixtures", str(ckpt), *c.fixture], work)
        opts = ["--tp", str(c.tp), "--profile", c.profile, "--act-dtype", c.dtype]
        run_cli(
            ["mpack", "convert", str(ckpt), "-o", str(sidecars[c.name]), "--quiet", *opts], work
        )
        by_tp.setdefault(c.tp, []).extend(_loads(c, ckpt, sidecars[c.name], stages))
    # one daemon per TP rank, which both stages attach to (the daemon holds the whole rank file)
    served = [(sidecars[c.name], r) for c in CASES for r in range(c.tp)]
    # and, in their own runtime directory, one per (TP rank, stage): each holds its stage only
    staged = [
        (sidecars[c.name], r, p, PP, stages) for c in CASES for r in range(c.tp) for p in range(PP)
    ]
    return serve_and_run(served, by_tp, work, runtime, pp=PP, staged=staged)


def stages(world: dict, case: Case, load: str = "default") -> list[list[dict[str, Any]]]:
    """``[stage][tp rank]``: the results of one load."""
    ranks = world[case.tp]
    return [
        [ranks[s * case.tp + t][f"{case.name}/{load}"] for t in range(case.tp)] for s in range(PP)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_each_stage_equals_vllms_own_load(world: dict, case: Case, path: str) -> None:
    for s, (want, got) in enumerate(
        zip(stages(world, case), stages(world, case, path), strict=True)
    ):
        for t, (w, g) in enumerate(zip(want, got, strict=True)):
            assert ok(g)["layers"] == ok(w)["layers"]
            assert_same_tensors(g["tensors"], w["tensors"], f"{case.name} {path} stage {s} tp {t}")
            if path != "mpack-never":  # zero-copy from the daemon, as at PP 1
                assert g["weights"]["backend"] != "private"
                assert all(v["same_ptr"] for v in g["marlin"].values()), g["marlin"]
            if path != "mpack-require":  # the stage's tensors only, not the rank's
                whole = stages(world, case, "mpack-require")[s][t]["weights"]["nbytes"]
                assert g["weights"]["nbytes"] < whole, (g["weights"], whole)


@pytest.mark.slow
def test_a_stage_daemon_of_another_split_is_refused_naming_both(world: dict) -> None:
    """The engine's split is ``VLLM_PP_LAYER_PARTITION=1,2``; the daemons of its stages serve
    vLLM's default [2, 1]. Every stage refuses them, naming both splits, under ``attach: auto``
    too (it does not load privately beside a misconfigured daemon), before any model memory."""
    served = [arch.Stage(s, (2, 1)) for s in range(PP)]
    engine = [arch.Stage(s, (1, 2)) for s in range(PP)]
    for mode in ("auto", "require"):
        for s, stage in enumerate(stages(world, SPLIT, f"split-stage-{mode}")):
            for res in stage:
                assert not res["ok"], res
                err = res["error"]
                assert err["type"] == "StageMismatchError", err
                assert f"serves pipeline {served[s]}" in err["message"], err["message"]
                assert f"this engine runs {engine[s]}" in err["message"], err["message"]
                assert err["linear_layers_built"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_stages_split_the_model_as_vllm_does(world: dict, case: Case) -> None:
    """Each stage built mpack's split (vLLM's ``get_pp_indices``) and only its layers; the first
    stage holds the embeddings, the last the final norm and lm_head (and, tied, the embeddings
    it shares); together they hold every decoder layer once."""
    seen: list[int] = []
    for s, stage in enumerate(stages(world, case, "mpack-never")):
        span = arch.pp_layers(case.layers, s, PP)
        for res in stage:
            names = set(ok(res)["tensors"])
            assert res["layers"] == [span.start, span.stop]
            built = {arch.decoder_index(n) for n in names} - {None}
            assert built == set(span), (s, sorted(built))
            assert ("model.embed_tokens.weight" in names) == (s == 0 or "tied" in case.name)
            assert ("model.norm.weight" in names) == (s == PP - 1)
            # a tied lm_head is the embeddings' parameter (named once, as embed_tokens)
            assert ("lm_head.weight" in names) == (s == PP - 1 and "tied" not in case.name)
        seen += list(span)
    assert seen == list(range(case.layers))


@pytest.mark.slow
def test_vllm_pp_layer_partition_is_followed(world: dict) -> None:
    """``VLLM_PP_LAYER_PARTITION`` moves the split; the sidecar needs nothing new for it."""
    want = [[0, 1], [1, 3]]
    for s, (d, m) in enumerate(
        zip(stages(world, SPLIT, "split-default"), stages(world, SPLIT, "split-mpack"), strict=True)
    ):
        for w, g in zip(d, m, strict=True):
            assert ok(w)["layers"] == ok(g)["layers"] == want[s]
            assert_same_tensors(g["tensors"], w["tensors"], f"split stage {s}")
    assert [list(arch.pp_layers(3, s, PP, PARTITION)) for s in range(PP)] == [[0], [1, 2]]


def _vllm_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int] | str:
    from vllm.distributed.utils import get_pp_indices

    try:
        return get_pp_indices(num_layers, pp_rank, pp_size)
    except ValueError:
        return "refused"


def _mpack_indices(num_layers: int, pp_rank: int, pp_size: int, spec: str | None) -> Any:
    try:
        span = arch.pp_layers(num_layers, pp_rank, pp_size, spec)
    except UsageError:
        return "refused"
    return (span.start, span.stop)


def test_pp_layers_is_vllms_get_pp_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpack's split (the main venv has no vLLM) gives vLLM 0.33.0's, for every layer count and
    stage count of a sweep, and under ``VLLM_PP_LAYER_PARTITION``: even and uneven splits, empty
    stages, and the specs vLLM refuses (wrong count, wrong sum, not integers)."""
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for n in range(1, 41):
        for size in range(1, 9):
            for r in range(size):
                assert _mpack_indices(n, r, size, None) == _vllm_indices(n, r, size), (n, r, size)
    for spec, n, size in [
        ("17,15", 32, 2),
        ("0,3", 3, 2),
        (" 2, 1", 3, 2),
        ("1,1,1", 3, 2),
        ("2,2", 3, 2),
        ("a,b", 3, 2),
        ("11,11,10", 32, 3),
        ("5,20,7", 32, 3),
    ]:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", spec)
        for r in range(size):
            assert _mpack_indices(n, r, size, spec) == _vllm_indices(n, r, size), (spec, r)

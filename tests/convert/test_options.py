"""One ``ConvertOptions`` for ``mpack convert`` and :func:`mpack.convert.convert`: the same
inputs reach the pipeline as the same object, and both start the early scheme check and the
read-ahead for a local source (:func:`mpack.convert.start`).

The pipeline itself is replaced by a recorder: nothing is converted here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mpack import cli, cudadrv, iokit
from mpack.convert import convert, pipeline, scheme_check
from mpack.convert.options import ConvertOptions
from mpack.errors import UsageError
from mpack.sidecar import CONFIG_NAME


class Recorded(UsageError):
    """Raised by the stand-in pipeline once it has noted its call (exit code 2 in the CLI)."""


@pytest.fixture
def calls(monkeypatch) -> list[dict[str, Any]]:
    """Each call of run_convert (the one run for any number of targets): how many targets,
    source, out, options, scheme_check."""
    seen: list[dict[str, Any]] = []

    def run(source, out, options, *, progress=None, scheme_check=None):
        many = "many" if options.many else "one"
        call = dict(run=many, source=str(source), out=str(out), options=options)
        seen.append({**call, "check": scheme_check})
        raise Recorded("recorded")

    monkeypatch.setattr(pipeline, "run_convert", run)
    return seen


CASES = [  # (CLI arguments, convert() keywords, which run, the options it gets)
    (
        ["--tp", "2", "--profile", "w8a8-marlin", "--device", "cpu", "--no-passthrough"],
        dict(tp=2, profile="w8a8-marlin", device="cpu", passthrough=False),
        "one",
        ConvertOptions(tp=2, profile="w8a8-marlin", device="cpu", passthrough=False),
    ),
    (
        ["--revision", "abc", "--act-dtype", "float16", "--fuse", "none", "--force"],
        dict(revision="abc", act_dtype="float16", fuse="none", force=True),
        "one",
        ConvertOptions(revision="abc", act_dtype="float16", fuse="none", force=True),
    ),
    (
        ["--tp", "1,2", "--profile", "w8a16,w8a8-marlin", "--skip-invalid", "--device", "cuda"],
        dict(tp=[1, 2], profile=["w8a16", "w8a8-marlin"], skip_invalid=True, device="cuda"),
        "many",
        ConvertOptions(
            tp=(1, 2), profile=("w8a16", "w8a8-marlin"), skip_invalid=True, device="cuda"
        ),
    ),
]


@pytest.mark.parametrize("argv, kwargs, run, expected", CASES)
def test_cli_and_library_hand_the_pipeline_the_same_options(
    calls, tmp_path: Path, argv: list[str], kwargs: dict[str, Any], run: str, expected: Any
) -> None:
    src, out = str(tmp_path / "no-checkpoint-here"), str(tmp_path / "out")
    assert cli.main(["convert", src, "-o", out, "--quiet", *argv]) == 2
    with pytest.raises(Recorded):
        convert(src, out, **kwargs)
    by_cli, by_library = calls
    assert by_cli == by_library
    assert by_cli["run"] == run and by_cli["options"] == expected
    assert by_cli["source"] == src and by_cli["out"] == out


def test_one_value_and_a_list_of_one_are_the_same_options() -> None:
    assert ConvertOptions(tp=[2], profile=["w8a16"]) == ConvertOptions(tp=2, profile="w8a16")
    assert [(t.tp, t.profile) for t in ConvertOptions(tp=[1, 2, 1]).specs] == [
        (1, "w8a16"),
        (2, "w8a16"),
    ]
    assert not ConvertOptions(tp=[2]).many and ConvertOptions(tp=[1, 2]).many


BAD_OPTIONS = [  # (keywords, what the UsageError says): refused when the options are built
    (dict(profile="w4a16"), "^profile must be one of w8a16, w8a8-marlin, got 'w4a16'$"),
    (dict(profile=["w8a16", "w8a8"]), "^profile must be one of .* got 'w8a8'$"),
    (dict(act_dtype="float32"), "^act_dtype must be bfloat16 or float16, got 'float32'$"),
    (dict(tp=0), "^tp must be at least 1, got 0$"),
    (dict(tp=[1, -2]), "^tp must be at least 1, got -2$"),
    (dict(tp=[]), "^tp is empty"),
    (dict(fuse="all"), "^fuse must be one of vllm, none, got 'all'$"),
    (dict(fuse="none", tp=2), r"^fuse='none' packs layers .* needs tp=1 \(got tp=2\)$"),
    (dict(backend="rocm"), "^backend must be auto or one of .* got 'rocm'$"),
    (dict(device="gpu"), "^device must be .* got 'gpu'$"),
    (dict(layout="flat"), "^layout must be one of auto, targets, got 'flat'$"),
]


@pytest.mark.parametrize("kwargs, message", BAD_OPTIONS)
def test_options_are_checked_once_when_built(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ConvertOptions(**kwargs)


def test_the_device_is_parsed_once(monkeypatch, tmp_path: Path) -> None:
    """One ``DeviceSpec.parse`` for a whole ``mpack.convert.convert``: in the options; the
    run (start, the run's checks, the backend) reads the parsed spec. A real conversion."""
    pytest.importorskip("torch")
    from mpack import device as device_mod
    from mpack.fixtures import make_checkpoint

    src = tmp_path / "ck"
    make_checkpoint(src, layers=2)
    calls: list[str] = []
    real = device_mod.DeviceSpec.parse.__func__

    def counting(cls, text, *a, **k):
        calls.append(text)
        return real(cls, text, *a, **k)

    monkeypatch.setattr(device_mod.DeviceSpec, "parse", classmethod(counting))
    opts = ConvertOptions(device="cpu", tp=[1, 2])
    assert (opts.device_spec.kind, calls) == ("cpu", ["cpu"])
    result = convert(src, tmp_path / "out", device="cpu", tp=[1, 2])
    assert len(result.results) == 2
    assert calls == ["cpu", "cpu"]  # the test's own options, then convert()'s: once each


def test_fuse_none_with_some_tp_1_is_left_to_the_plan() -> None:
    """A list where one target can be made is not a typo: the plan refuses the others (or
    skips them with skip_invalid)."""
    assert [t.tp for t in ConvertOptions(fuse="none", tp=[1, 2]).specs] == [1, 2]


def test_options_module_is_a_leaf() -> None:
    """convert/options.py imports errors, device and target only (issue 36)."""
    import ast

    tree = ast.parse((Path(pipeline.__file__).parent / "options.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    ours = {m for m in imported if m.startswith("mpack")}
    assert ours == {"mpack.errors", "mpack.device", "mpack.target"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_library_convert_starts_the_scheme_check_and_the_read_ahead(
    calls, monkeypatch, tmp_path: Path, device: str
) -> None:
    events: list[Any] = []

    class FakeCheck:
        def __init__(self, source: Any) -> None:
            events.append(("check", str(source)))

        def cancel(self) -> None:
            events.append("cancel")

    monkeypatch.setattr(scheme_check, "SchemeCheck", FakeCheck)
    monkeypatch.setattr(iokit, "prefetch", lambda paths: events.append(("prefetch", paths)))
    monkeypatch.setattr(cudadrv, "library_files", lambda: [Path("/libcuda-stand-in.so")])
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / CONFIG_NAME).write_text("{}")
    shards = [src / "model-00002.safetensors", src / "model-00001.safetensors"]
    for p in shards:
        p.write_bytes(b"")
    with pytest.raises(Recorded):
        convert(src, tmp_path / "out", device=device)
    libs = [Path("/libcuda-stand-in.so")] if device == "cuda" else []
    assert events == [("check", str(src)), ("prefetch", libs + sorted(shards)), "cancel"]
    assert isinstance(calls[0]["check"], FakeCheck)  # the pipeline waits on the early check


def test_a_remote_source_starts_neither(calls, monkeypatch, tmp_path: Path) -> None:
    started: list[str] = []
    monkeypatch.setattr(scheme_check, "SchemeCheck", lambda s: started.append("check"))
    monkeypatch.setattr(iokit, "prefetch", lambda paths: started.append("prefetch"))
    with pytest.raises(Recorded):
        convert("some-org/some-model", tmp_path / "out")
    assert started == [] and calls[0]["check"] is None

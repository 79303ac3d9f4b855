"""mpack/device.py: the one parser of device values (``--device``, ``--rederive-device`` and the
device keys daemons go by), what it takes and refuses, that every caller goes through it, and
that no other module parses device strings."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mpack.device import CONVERT, KEY, SERVE, DeviceSpec, Grammar, no_cuda_here
from mpack.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
#: The folders of the package's sources (pyproject.toml's package-dir).
PACKAGES = ("mpack", "convert", "runtime", "verify")
UUID = "GPU-0f1e2d3c-4b5a-6978-8a9b-acbdcedf0011"


def package_sources() -> dict[str, str]:
    """``{path relative to the root: text}`` of every Python source of the package."""
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for folder in PACKAGES
        for p in sorted((ROOT / folder).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


# --- what it takes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar, text, want",
    [
        (SERVE, "cpu", DeviceSpec("cpu")),
        (SERVE, "cuda", DeviceSpec("cuda")),
        (SERVE, "cuda:3", DeviceSpec("cuda", 3)),
        (SERVE, " CUDA:12 ", DeviceSpec("cuda", 12)),  # serve's --device: any case, blanks ignored
        (SERVE, "CPU", DeviceSpec("cpu")),
        (CONVERT, "auto", DeviceSpec("auto")),
        (CONVERT, "cpu", DeviceSpec("cpu")),
        (CONVERT, "cuda", DeviceSpec("cuda")),
        (CONVERT, "cuda:0", DeviceSpec("cuda", 0)),
        (KEY, "cpu", DeviceSpec("cpu")),
        (KEY, f"cuda:{UUID}", DeviceSpec("cuda", uuid=UUID)),
    ],
)
def test_accepted_forms(grammar: Grammar, text: str, want: DeviceSpec) -> None:
    got = DeviceSpec.parse(text, grammar)
    assert got == want
    assert DeviceSpec.parse(str(got), grammar) == got  # str() spells it back


def test_canonical_spelling() -> None:
    assert [str(DeviceSpec.parse(t)) for t in ("CPU", " cuda ", "Cuda:7")] == [
        "cpu",
        "cuda",
        "cuda:7",
    ]
    assert str(DeviceSpec("cuda", uuid=UUID)) == f"cuda:{UUID}"


def test_ordinal() -> None:
    """``cuda`` and ``auto`` name the device torch takes first; a UUID names no ordinal."""
    assert DeviceSpec.parse("cuda:3").ordinal == 3
    assert DeviceSpec.parse("cuda").ordinal == 0
    assert DeviceSpec.parse("auto", CONVERT).ordinal == 0
    with pytest.raises(ValueError, match="by UUID"):
        _ = DeviceSpec("cuda", uuid=UUID).ordinal


def test_of_parses_text_and_keeps_a_spec() -> None:
    """:meth:`DeviceSpec.of`: text is parsed, a spec already parsed is taken as it is."""
    assert DeviceSpec.of("cuda:3", CONVERT) == DeviceSpec("cuda", 3)
    spec = DeviceSpec.parse("cuda:3", CONVERT)
    assert DeviceSpec.of(spec, CONVERT) is spec


# --- what it refuses, and in which words --------------------------------------------------------

SERVE_FORMS = "must be cpu, cuda or cuda:N, got"
CONVERT_FORMS = "must be auto, cpu, cuda or cuda:<i>, got"


@pytest.mark.parametrize(
    "grammar, option, text, message",
    [
        *[
            (SERVE, "--device", t, f"--device {SERVE_FORMS} {t!r}")
            for t in (
                "gpu",
                "cuda:",
                "cuda:-1",
                "cuda:x",
                "cpu:0",
                "auto",
                f"cuda:{UUID}",
                "",
                "cuda 0",
            )
        ],
        *[
            (CONVERT, "--device", t, f"--device {CONVERT_FORMS} {t!r}")
            for t in ("tpu", "meta", "CUDA", " cpu", "auto:0", "cuda:²", f"cuda:{UUID}", "cuda:")
        ],
        (CONVERT, "--rederive-device", "meta", f"--rederive-device {CONVERT_FORMS} 'meta'"),
        *[
            (KEY, "device key", t, f"device key must be cpu or cuda:GPU-<uuid>, got {t!r}")
            for t in ("cuda:0", "cuda", "auto", "cuda:GPU-", f"CUDA:{UUID}")
        ],
    ],
)
def test_refused_forms(grammar: Grammar, option: str, text: str, message: str) -> None:
    with pytest.raises(UsageError) as e:
        DeviceSpec.parse(text, grammar, option)
    assert str(e.value) == message
    assert e.value.exit_code == 2


# --- every caller goes through it ---------------------------------------------------------------


class Sentinel(Exception):
    pass


def _verify_forward(text: str) -> Any:
    from mpack.verify import verify

    return verify(ROOT / "no-such-sidecar", forward=True, device=text)


def _verify_rederive(text: str) -> Any:
    from mpack.verify import verify

    return verify(ROOT / "no-such-sidecar", rederive_device=text)


def _load(text: str) -> Any:
    from mpack.runtime import load

    return load(ROOT / "no-such-sidecar", device=text)


def _entry(module: str, name: str, *args: Any) -> Callable[[str], Any]:
    def call(text: str) -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)(text, *args)

    return call


@pytest.mark.parametrize(
    "call",
    [
        _entry("mpack.runtime.protocol", "checked_device"),
        _entry("mpack.runtime.protocol", "resolve_device"),
        _entry("mpack.convert.backends", "check_device_here"),
        _entry("mpack.convert.backends", "check_cuda_here", 1),
        _entry("mpack.convert.backends", "prefetch_files"),
        _verify_forward,
        _verify_rederive,
        _load,
    ],
    ids=lambda c: getattr(c, "__name__", "?"),
)
def test_every_caller_parses_with_it(call: Callable[[str], Any], monkeypatch) -> None:
    """Each place that reads a device value asks :meth:`DeviceSpec.parse`, first."""

    def parse(cls: type, text: str, *args: Any) -> DeviceSpec:
        raise Sentinel(text)

    monkeypatch.setattr(DeviceSpec, "parse", classmethod(parse))
    with pytest.raises(Sentinel, match="cuda:5"):
        call("cuda:5")


@pytest.mark.parametrize(
    "grammar, spec",
    [
        (CONVERT, DeviceSpec("cuda", uuid=UUID)),
        (SERVE, DeviceSpec("auto")),
        (KEY, DeviceSpec("cuda", 0)),
    ],
)
def test_of_refuses_a_spec_as_its_text(grammar: Grammar, spec: DeviceSpec) -> None:
    """A spec outside ``grammar``'s forms: the error its text gets from :meth:`DeviceSpec.parse`."""
    with pytest.raises(UsageError) as want:
        DeviceSpec.parse(str(spec), grammar, "--opt")
    with pytest.raises(UsageError) as got:
        DeviceSpec.of(spec, grammar, "--opt")
    assert str(got.value) == str(want.value) and got.value.exit_code == 2


def _open_backend(device: Any) -> Any:
    from mpack.convert.backends import open_backend

    return open_backend(device, None, backend="no-such-backend")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call, device",
    [
        (_entry("mpack.convert.backends", "check_device_here"), DeviceSpec("cuda", 5)),
        (_entry("mpack.convert.backends", "check_cuda_here", 1), DeviceSpec("cuda", 5)),
        (_entry("mpack.convert.backends", "check_cuda_here", 0), DeviceSpec("cuda", 5)),
        (_entry("mpack.convert.backends", "prefetch_files"), DeviceSpec("cpu")),
        (_open_backend, DeviceSpec("cpu")),
    ],
    ids=["check_device_here", "check_cuda_here", "check_cuda_here_none", "prefetch", "open"],
)
def test_a_parsed_spec_is_not_parsed_again(
    call: Callable[[Any], Any], device: DeviceSpec, monkeypatch
) -> None:
    """The convert path's functions take the spec parsed once (``ConvertOptions``) as well as
    text, and say what they say of its text, without parsing it again."""
    import mpack.convert.backends as backends

    monkeypatch.setattr(backends, "no_cuda_here", lambda: True)

    def outcome(value: Any) -> Any:
        try:
            return call(value)
        except UsageError as e:
            return (str(e), e.hint)

    want = outcome(str(device))

    def parse(cls: type, text: str, *args: Any) -> DeviceSpec:
        raise Sentinel(text)

    monkeypatch.setattr(DeviceSpec, "parse", classmethod(parse))
    assert outcome(device) == want


def test_socket_names_read_the_key_with_it() -> None:
    from mpack.runtime.protocol import socket_name

    digest = "ab" * 32
    assert socket_name(digest, 0, f"cuda:{UUID}") == f"{digest[:16]}-r0-gpu-0f1e2d3c4b5a.sock"
    assert socket_name(digest, 1, "cpu") == f"{digest[:16]}-r1-cpu.sock"
    with pytest.raises(UsageError, match="device key must be"):
        socket_name(digest, 0, "cuda:0")  # an ordinal is no key: it differs from process to process


# --- no other parser ----------------------------------------------------------------------------

#: Functions that parsed device strings before mpack/device.py: gone, and called nowhere.
RETIRED = {
    "parse_device_spec",
    "parse_device",
    "check_device_name",
    "ordinal_of",
    "torch_device",
    "open_device",
    "open_gpu",
}
#: Source text that reads a device string by hand.
HAND_PARSING = [
    re.compile(r"""partition\(\s*["']:["']\s*\)"""),
    re.compile(r"""startswith\(\s*["']cuda"""),
    re.compile(r"""fullmatch\(\s*r?["']cuda"""),
    re.compile(r"""["']cuda:GPU-["']"""),
]
#: path -> why it still reads a device string itself (a file this change did not own).
NOT_YET: dict[str, str] = {}


def test_no_retired_parser_is_defined_or_called() -> None:
    found = []
    for path, text in package_sources().items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name in RETIRED:
                    found.append(f"{path}:{node.lineno} calls {name}")
            elif isinstance(node, ast.FunctionDef) and node.name in RETIRED:
                found.append(f"{path}:{node.lineno} defines {node.name}")
            elif isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) in RETIRED | {"resolve_device"} for t in node.targets
            ):
                found.append(f"{path}:{node.lineno} keeps an alias")
    assert not found, "call mpack.device.DeviceSpec.parse instead:\n" + "\n".join(found)


def test_no_module_parses_device_strings_by_hand() -> None:
    found = [
        f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
        for path, text in package_sources().items()
        if path != "mpack/device.py" and path not in NOT_YET
        for pattern in HAND_PARSING
        for m in pattern.finditer(text)
    ]
    assert not found, "parse with mpack.device.DeviceSpec.parse:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "name, home",
    [
        ("resolve_device", "runtime/protocol.py"),
        ("no_cuda_here", "mpack/device.py"),
    ],
)
def test_defined_once(name: str, home: str) -> None:
    """One function of each name in the package: the runtime's ``resolve_device`` (convert's
    went with the backends), ``no_cuda_here`` here."""
    homes = [
        path
        for path, text in package_sources().items()
        for node in ast.walk(ast.parse(text, path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
    ]
    assert homes == [home]


def test_no_cuda_here_reads_cuda_visible_devices(monkeypatch) -> None:
    for hidden in ("", "-1", " "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert no_cuda_here()


# --- lean ---------------------------------------------------------------------------------------


def test_imports_without_torch() -> None:
    """Parsing needs nothing past the standard library and mpack.errors: no torch, no CUDA."""
    code = (
        "import sys\n"
        "from mpack.device import CONVERT, DeviceSpec, no_cuda_here\n"
        "DeviceSpec.parse('cuda:1'); DeviceSpec.parse('auto', CONVERT); no_cuda_here()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mpack', 'torch', 'cuda', 'numpy')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        "['mpack',",
        "'mpack._checkout',",
        "'mpack.device',",
        "'mpack.errors']",
    ]

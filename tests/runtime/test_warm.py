"""``mpack.runtime.warm``: what the first ``attach()`` of a process would import, paid ahead
(Note [warm attach] in runtime/__init__.py), without torch and without touching a device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import mpack.runtime
before = set(sys.modules)
mpack.runtime.warm(sys.argv[1])
new = sorted(m for m in set(sys.modules) - before if m.startswith(("mpack", "torch", "cuda")))
print(json.dumps(new))
"""


def _warmed(device: str) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, device], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_warm_imports_the_host_attach_path_and_no_torch() -> None:
    got = _warmed("cpu")
    for name in ("mpack.hub_sidecar", "mpack.runtime.client", "mpack.runtime.memfd"):
        assert name in got
    assert "mpack.runtime.cuda_vmm" not in got
    assert not [m for m in got if m.split(".")[0] in ("torch", "cuda")]


def test_warm_for_cuda_imports_the_vmm_backend_without_a_device() -> None:
    got = _warmed("cuda:0")  # also on a machine with no GPU: nothing is initialised
    assert "mpack.runtime.cuda_vmm" in got and "mpack.runtime.client" in got
    assert not [m for m in got if m.split(".")[0] == "torch"]


def test_warm_refuses_a_bad_device_like_attach() -> None:
    from mpack.errors import UsageError
    from mpack.runtime import warm

    with pytest.raises(UsageError, match="^device must be"):  # the API's words, not --device
        warm("gpu0")


@pytest.fixture
def fake_driver(monkeypatch):
    """A stand-in driver (tests/runtime/fake_driver.py) on a machine that may have a GPU."""
    import mpack.device
    from tests.runtime.fake_driver import FakeDriver, install

    fake = FakeDriver()
    install(fake, monkeypatch)
    monkeypatch.setattr(mpack.device, "no_cuda_here", lambda: False)
    return fake


def test_warm_for_cuda_loads_the_driver_without_initialising_it(fake_driver) -> None:
    """The driver's entry points are looked up ahead (Note [warm attach]) by the one call that
    needs no cuInit; no context, no device, once per process."""
    from mpack.runtime import warm

    warm("cuda:0")
    assert fake_driver.calls == ["cuDriverGetVersion"]
    assert not fake_driver.initialised
    warm("cuda:1")
    assert fake_driver.calls == ["cuDriverGetVersion"]


def test_warm_for_cuda_calls_no_driver_where_no_gpu_is_visible(fake_driver, monkeypatch) -> None:
    import mpack.device
    from mpack.runtime import warm

    monkeypatch.setattr(mpack.device, "no_cuda_here", lambda: True)
    warm("cuda")
    assert fake_driver.calls == []


def test_warm_for_cuda_does_not_raise_when_the_driver_does_not_load(fake_driver) -> None:
    from mpack.runtime import warm

    fake_driver.fail["cuDriverGetVersion"] = 1
    warm("cuda:0")  # the first attach will say what is wrong
    warm("cuda:0")  # and a later warm tries again
    assert fake_driver.calls == ["cuDriverGetVersion", "cuDriverGetVersion"]

"""The parameters built without memory (runtime/vllm/placeholders.py): what protects them.

The loads themselves (every placeholder replaced, the models equal to vLLM's own load) are
tests/vllm/test_vllm_loader.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpack.errors import MpackError
from mpack.runtime.vllm.placeholders import building


class FP8Like(nn.Module):
    """A module as vLLM builds an FP8 linear: a quantization ``scheme``, then its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.scheme = object()
        self.weight = nn.Parameter(torch.empty(64, 32), requires_grad=False)
        self.weight.weight_loader = "vLLM's"  # set after registration, as vLLM does
        self.input_scale = nn.Parameter(torch.empty(1), requires_grad=False)


def test_a_filled_parameter_gets_a_placeholder_that_refuses_a_copy() -> None:
    with building(True) as ph:
        m = FP8Like()
        plain = nn.Linear(32, 64)  # not the sidecar's: built as it is
    assert m.weight.shape == (64, 32) and m.weight.stride() == (0, 0)
    assert m.weight.weight_loader == "vLLM's"  # the same parameter object
    assert ph.bytes_saved == 64 * 32 * 4 and ph.holds(m.weight)
    assert not ph.holds(m.input_scale) and m.input_scale.stride() == (1,)
    assert plain.weight.stride() == (32, 1) and not ph.holds(plain.weight)
    with pytest.raises(RuntimeError, match="single memory location"):
        m.weight.data.copy_(torch.ones(64, 32))


def test_a_placeholder_left_is_refused_by_name() -> None:
    with building(True) as ph:
        m = FP8Like()
    with pytest.raises(MpackError, match="1 parameter.*weight"):
        ph.check_replaced(m)
    m.weight.data = torch.ones(64, 32)  # the sidecar's tensor
    ph.check_replaced(m)


def test_materialize_gives_memory_before_a_copy() -> None:
    with building(True) as ph:
        m = FP8Like()
    ph.materialize(m.weight, "weight")
    m.weight.data.copy_(torch.full((64, 32), 2.0))
    assert m.weight.stride() == (32, 1) and float(m.weight.sum()) == 2.0 * 64 * 32
    assert ph.materialized == ["weight"]
    ph.check_replaced(m)
    ph.materialize(m.weight, "weight")  # no placeholder any more: nothing to do
    assert ph.materialized == ["weight"]


def test_the_hook_is_gone_after_the_build() -> None:
    with building(True):
        pass
    after = FP8Like()
    assert after.weight.stride() == (32, 1)

"""What a conversion is asked to do, checked once: :class:`ConvertOptions`.

``mpack convert``, :func:`mpack.convert.convert`, :func:`mpack.convert.start` and
:func:`mpack.convert.pipeline.run_convert` all take this one object rather than each spelling
out the options. Building one checks every value that needs no checkpoint (a misspelt profile,
activation dtype, fusion, backend, layout or device, a TP below 1) and parses the device once,
so the run never checks them again. This module is a leaf: it imports :mod:`mpack.errors`,
:mod:`mpack.device` and :mod:`mpack.target` only, so the CLI builds one before it forks the
scheme check (Note [scheme check in a child] in mpack/convert/scheme_check.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpack.device import CONVERT, DeviceSpec
from mpack.errors import UsageError, arg
from mpack.target import ACT_DTYPES, FUSIONS, PROFILES, check_layout

#: The backends, by name (Note [choosing a backend] in mpack/convert/backends/__init__.py).
BACKENDS = ("host", "driver", "torch")


@dataclass(frozen=True)
class TargetSpec:
    """One target asked for: a TP size, a profile and an activation dtype (None: the
    checkpoint's)."""

    tp: int
    profile: str
    act_dtype: str | None
    #: A MoE model's experts split whole across the ranks (:data:`mpack.target.EXPERT_PARALLEL`);
    #: never at TP 1, where there is one rank and nothing to split.
    ep: bool = False


def check_fusion_tp(fusion: str, tp: int) -> None:
    """``fuse="none"`` packs layers under their checkpoint names, which only TP 1 can."""
    if fusion == "none" and tp != 1:
        raise UsageError(
            f"{arg('fuse', 'none')} packs layers under checkpoint names and needs "
            f"{arg('tp', 1)} (got {arg('tp', tp)})"
        )


def check_backend_name(backend: str) -> None:
    """Refuse a ``backend`` that is neither ``auto`` nor one of :data:`BACKENDS`."""
    if backend != "auto" and backend not in BACKENDS:
        raise UsageError(
            f"{arg('backend')} must be auto or one of {', '.join(BACKENDS)}, got {backend!r}"
        )


def _one_or_many(value: Any) -> Any:
    """A list of values as a tuple, a list of one as that value; a single value as it is."""
    if value is None or isinstance(value, (str, int)) or not isinstance(value, Iterable):
        return value
    values = tuple(value)
    return values[0] if len(values) == 1 else values


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, tuple) else [value]


def _specs(tp: Any, profile: Any, act_dtype: Any, ep: Any = False) -> tuple[TargetSpec, ...]:
    """The cross product of the lists, in the order given, repeats dropped; each value checked.
    A misspelt value refuses the run whatever ``skip_invalid`` says: it is a typo, not a target
    this checkpoint cannot have. Expert parallelism at TP 1 is the TP-1 target (vLLM's own
    rule: one rank holds every expert either way)."""
    tps, profiles, acts, eps = _listed(tp), _listed(profile), _listed(act_dtype), _listed(ep)
    for what, values in (
        ("tp", tps),
        ("profile", profiles),
        ("act_dtype", acts),
        ("ep", eps),
    ):
        if not values:
            raise UsageError(f"{arg(what)} is empty; give at least one value")
    for p in profiles:
        if p not in PROFILES:
            raise UsageError(f"{arg('profile')} must be one of {', '.join(PROFILES)}, got {p!r}")
    for a in acts:
        if a is not None and a not in ACT_DTYPES:
            raise UsageError(f"{arg('act_dtype')} must be {' or '.join(ACT_DTYPES)}, got {a!r}")
    for t in tps:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise UsageError(f"{arg('tp')} must be at least 1, got {t}")
    for e in eps:
        if not isinstance(e, bool):
            raise UsageError(f"{arg('ep')} must be off or on, got {e!r}")
    specs = [
        TargetSpec(t, p, a, e and t > 1)
        for t, e, p, a in itertools.product(tps, eps, profiles, acts)
    ]
    return tuple(dict.fromkeys(specs))


@dataclass(frozen=True)
class ConvertOptions:
    """The options of one conversion (their meaning: :func:`mpack.convert.convert`), checked.

    ``tp``, ``profile`` and ``act_dtype`` take one value or several; their cross product is the
    set of targets (:attr:`specs`). A list is kept as a tuple and a list of one as its value,
    so ``ConvertOptions(tp=[2]) == ConvertOptions(tp=2)``: both name the same single target.
    ``device_spec`` is ``device`` parsed (:class:`mpack.device.DeviceSpec`).

    Raises:
        UsageError: a misspelt profile, activation dtype, fusion, backend or device, an empty
            list, a TP below 1, or ``--fuse none`` where no target has TP 1.
    """

    revision: str | None = None
    profile: str | Sequence[str] = "w8a16"
    act_dtype: str | Sequence[str] | None = None
    tp: int | Sequence[int] = 1
    #: Expert parallelism, off (False) and/or on (True), crossed with the TP sizes.
    ep: bool | Sequence[bool] = False
    fuse: str = "vllm"
    device: str = "auto"
    passthrough: bool = True
    force: bool = False
    skip_invalid: bool = False
    #: ``auto`` or a backend's name (:data:`BACKENDS`): the one to use.
    backend: str = "auto"
    #: Where the sidecars go (:data:`mpack.target.LAYOUTS`, Note [target layout] in
    #: mpack/target_dirs.py): ``auto`` (one target at ``-o`` itself, unless it already holds
    #: targets; several under ``OUT/<target>/``) or ``targets`` (always ``OUT/<target>/``).
    layout: str = "auto"
    #: What is turned off (:data:`mpack.convert.backends.SWITCHES`); None: what the environment
    #: turns off.
    disable: frozenset[str] | None = None
    #: The targets, in the order given, repeats dropped.
    specs: tuple[TargetSpec, ...] = field(init=False, compare=False, repr=False)
    device_spec: DeviceSpec = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("profile", "act_dtype", "tp", "ep"):
            object.__setattr__(self, name, _one_or_many(getattr(self, name)))
        if self.disable is not None:
            object.__setattr__(self, "disable", frozenset(self.disable))
        specs = _specs(self.tp, self.profile, self.act_dtype, self.ep)
        if self.fuse not in FUSIONS:
            raise UsageError(
                f"{arg('fuse')} must be one of {', '.join(FUSIONS)}, got {self.fuse!r}"
            )
        if all(s.tp != 1 for s in specs):
            check_fusion_tp(self.fuse, specs[0].tp)  # no target can be made: the options' error
        check_backend_name(self.backend)
        check_layout(self.layout)
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "device_spec", DeviceSpec.of(self.device, CONVERT))

    @property
    def many(self) -> bool:
        """More than one target: ``-o`` is then a directory of sidecars, ``OUT/<target>/`` (as
        it is for one with ``layout="targets"``: :func:`mpack.target_dirs.uses_target_dirs`)."""
        return len(self.specs) > 1

"""What a conversion is asked to do, held once: :class:`ConvertOptions`.

``mpack convert``, :func:`mpack.convert.convert`, :func:`mpack.convert.start`,
:func:`mpack.convert.pipeline.run_convert` and :func:`mpack.convert.multi.run_convert_many` all
take this one object rather than each spelling out the options. Importing this module is cheap
(no torch, no compressed-tensors, no pipeline): the CLI builds one before it forks the scheme
check (Note [scheme check in a child] in mpack/convert/scheme_check.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpack.errors import UsageError

if TYPE_CHECKING:
    from mpack.convert.backends import Backend
    from mpack.convert.multi import TargetSpec
    from mpack.convert.plan import Plan
    from mpack.convert.timeline import Timeline


def _one_or_many(value: Any) -> Any:
    """A list of values as a tuple, a list of one as that value; a single value as it is."""
    if value is None or isinstance(value, (str, int)) or not isinstance(value, Iterable):
        return value
    values = tuple(value)
    return values[0] if len(values) == 1 else values


@dataclass(frozen=True)
class ConvertOptions:
    """The options of one conversion (their meaning: :func:`mpack.convert.convert`).

    ``tp``, ``profile`` and ``act_dtype`` take one value or several; their cross product is the
    set of targets (:meth:`targets`). A list is kept as a tuple and a list of one as its value,
    so ``ConvertOptions(tp=[2]) == ConvertOptions(tp=2)``: both name the same single target.
    """

    revision: str | None = None
    profile: str | Sequence[str] = "w8a16"
    act_dtype: str | Sequence[str] | None = None
    tp: int | Sequence[int] = 1
    fuse: str = "vllm"
    device: str = "auto"
    passthrough: bool = True
    force: bool = False
    skip_invalid: bool = False
    #: ``auto`` or a backend's name (:data:`mpack.convert.backends.BACKENDS`): the one to use.
    backend: str = "auto"
    #: What is turned off (:data:`mpack.convert.backends.SWITCHES`); None: what the environment
    #: turns off.
    disable: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("profile", "act_dtype", "tp"):
            object.__setattr__(self, name, _one_or_many(getattr(self, name)))
        if self.disable is not None:
            object.__setattr__(self, "disable", frozenset(self.disable))

    def open_backend(
        self, plan: Plan, tl: Timeline | None = None, opened: list[Backend] | None = None
    ) -> Backend:
        """The backend these options ask for, for ``plan``
        (:func:`mpack.convert.backends.open_backend`; ``opened``: those this run opened)."""
        from mpack.convert.backends import open_backend

        return open_backend(
            self.device, plan, backend=self.backend, disabled=self.disable, tl=tl, opened=opened
        )

    def turned_off(self, what: str) -> bool:
        """Whether ``what`` (one of :data:`mpack.convert.backends.SWITCHES`) is off: in
        ``disable`` when given, else in the environment."""
        from mpack.convert.backends import turned_off

        return what in turned_off(self.disable)

    def targets(self) -> list[TargetSpec]:
        """The targets, in the order given, repeats dropped
        (:func:`mpack.convert.multi.target_specs`)."""
        from mpack.convert.multi import target_specs

        return target_specs(self.tp, self.profile, self.act_dtype)

    def target(self) -> tuple[str, str | None, int]:
        """``(profile, act_dtype, tp)`` of the one target these options name (not checked
        further: :func:`mpack.convert.pipeline.run_convert` does that)."""
        if any(isinstance(v, tuple) for v in (self.profile, self.act_dtype, self.tp)):
            raise UsageError(
                "these options name several targets; run_convert makes one",
                hint="use mpack.convert.convert, which makes each of them",
            )
        return self.profile, self.act_dtype, self.tp  # type: ignore[return-value]

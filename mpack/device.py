"""Device specs: the one parser of ``--device`` values and of the device keys daemons go by.

The forms, and the options that take each (a :class:`Grammar`):

================  ==========================================================================
``auto``          convert's ``--device`` and verify's ``--rederive-device`` only: the fastest
                  path here (Note [auto device] in convert/backends/__init__.py)
``cpu``           every option
``cuda``          the CUDA device torch takes first (ordinal 0)
``cuda:N``        CUDA device ordinal N as this process numbers them (CUDA_VISIBLE_DEVICES
                  applies)
``cuda:GPU-<u>``  a device key only (socket names, ``attach``'s hello): the GPU by its UUID as
                  nvidia-smi prints it, the same in every process whatever it sees
================  ==========================================================================

A value outside its option's forms is a :class:`mpack.errors.UsageError` (exit code 2) worded
``<option> must be <forms>, got '<value>'``. Whether the device is *here* is for the caller:
the runtime asks torch (:func:`mpack.runtime.protocol.checked_device`), a conversion the driver
or torch (:func:`mpack.convert.backends.check_cuda_here`); :func:`no_cuda_here` answers the one
question that needs neither. Nothing here imports torch or starts CUDA.

A value is parsed once: functions that take a device take the text or the :class:`DeviceSpec`
it was parsed into, and read either with :meth:`DeviceSpec.of` (a spec is not parsed again).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Literal

from mpack.errors import UsageError, arg

__all__ = ["CONVERT", "KEY", "SERVE", "DeviceSpec", "Grammar", "no_cuda_here"]


@dataclass(frozen=True)
class Grammar:
    """The forms one family of options takes, and how it reads them."""

    forms: str  # the forms, as the error message lists them
    auto: bool = False  # takes ``auto``
    ordinal: bool = True  # takes ``cuda`` and ``cuda:N``
    uuid: bool = False  # takes ``cuda:GPU-<uuid>``
    loose: bool = False  # ignores case and surrounding blanks (then no UUID: it is case-sensitive)


#: ``--device`` of serve, attach, load and ``verify --forward``: any case, blanks ignored.
SERVE = Grammar("cpu, cuda or cuda:N", loose=True)
#: ``--device`` of convert and ``--rederive-device`` of verify: the exact names.
CONVERT = Grammar("auto, cpu, cuda or cuda:<i>", auto=True)
#: The device key a daemon is named and found by (:class:`mpack.runtime.protocol.Device`).
KEY = Grammar("cpu or cuda:GPU-<uuid>", ordinal=False, uuid=True)

# \d, not isdigit(): every character \d matches is one int() reads (isdigit() also takes "²")
_FORM = re.compile(r"(?P<kind>auto|cpu|cuda)(?::(?:(?P<index>\d+)|(?P<uuid>GPU-[0-9A-Fa-f-]+)))?")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device value. ``str()`` gives it back in its canonical spelling.

    ``kind`` is ``auto``, ``cpu`` or ``cuda``; ``index`` is N of ``cuda:N`` (None otherwise, a
    bare ``cuda`` included); ``uuid`` is ``GPU-<uuid>`` of ``cuda:GPU-<uuid>`` (None otherwise).
    """

    kind: Literal["auto", "cpu", "cuda"]
    index: int | None = None
    uuid: str | None = None

    @classmethod
    def parse(cls, text: str, grammar: Grammar = SERVE, option: str = "device") -> DeviceSpec:
        """``text`` read by ``grammar``. ``option``: the argument named in the error (through
        :func:`mpack.errors.arg`: ``device`` in Python, ``--device`` under the CLI).

        Raises:
            UsageError: ``text`` is not one of ``grammar``'s forms.
        """
        s = str(text).strip().lower() if grammar.loose else str(text)
        m = _FORM.fullmatch(s)
        if m is None or not _takes(grammar, m["kind"], m["index"], m["uuid"]):
            raise UsageError(f"{arg(option)} must be {grammar.forms}, got {text!r}")
        return cls(m["kind"], None if m["index"] is None else int(m["index"]), m["uuid"])

    @classmethod
    def of(
        cls, device: str | DeviceSpec, grammar: Grammar = SERVE, option: str = "device"
    ) -> DeviceSpec:
        """``device`` as a spec: text read by :meth:`parse`, a spec already parsed (once, by the
        caller) taken as it is, if ``grammar`` takes its form (the same error as its text).

        Raises:
            UsageError: ``device`` is not one of ``grammar``'s forms.
        """
        if not isinstance(device, DeviceSpec):
            return cls.parse(device, grammar, option)
        if not _takes(grammar, device.kind, device.index, device.uuid):
            raise UsageError(f"{arg(option)} must be {grammar.forms}, got {str(device)!r}")
        return device

    @property
    def ordinal(self) -> int:
        """The CUDA ordinal: N of ``cuda:N``; 0 for ``cuda`` and ``auto``, the device torch
        takes first (and for ``cpu``, which has none).

        Raises:
            ValueError: a UUID, which names a GPU but not its ordinal in this process.
        """
        if self.uuid is not None:
            raise ValueError(f"{self} names a GPU by UUID, not by ordinal")
        return 0 if self.index is None else self.index

    def __str__(self) -> str:
        if self.uuid is not None:
            return f"{self.kind}:{self.uuid}"
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def _takes(grammar: Grammar, kind: str, index: str | int | None, uuid: str | None) -> bool:
    """Whether ``grammar`` takes the form ``_FORM`` matched (or a :class:`DeviceSpec` holds)."""
    if kind != "cuda":  # auto, cpu: no suffix
        return index is None and uuid is None and (kind == "cpu" or grammar.auto)
    return grammar.uuid if uuid is not None else grammar.ordinal


def no_cuda_here() -> bool:
    """Whether this process surely sees no CUDA device, known without torch:
    ``CUDA_VISIBLE_DEVICES`` hides them all, or (Linux) no GPU driver's device node exists
    (NVIDIA's ``/dev/nvidiactl``, or ``/dev/kfd`` of ROCm, which torch also calls CUDA).
    False means "ask torch"."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return True
    if not sys.platform.startswith("linux"):
        return False
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))

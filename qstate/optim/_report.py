"""What an optimizer's states hold, said where users look: :class:`StateNbytes` (this rank's state bytes
per format against float32), the text of the first step's record on the ``qstate`` logger
(:func:`policy_summary`), and the warnings of documented weak combinations (:data:`WEAK_COMBINATIONS`).

Counting rules: a state is one of an update rule's state tensors (``exp_avg``, ``momentum_buffer``, ...;
never the ``step`` count). Everything counted is local to this rank: a DTensor state counts its local
shard (elements and bytes), as :func:`qstate.distributed.local_nbytes` does, so the sum over ranks is
the whole state for ``Shard`` placements and a replica per rank for ``Replicate``. A
:class:`~qstate.QuantizedState` holds :meth:`~qstate.QuantizedState.storage_nbytes` (codes, scales and
its code map), a plain tensor ``numel * element_size``; ``fp32_nbytes`` is what float32 states of the
same elements would hold (``4 * elements``).
"""

from __future__ import annotations

import logging
import pathlib
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import Tensor

from .._dtensor import local_of
from .._state import QuantizedState
from ..distributed import local_nbytes

__all__ = ["FormatNbytes", "StateNbytes", "count_nbytes", "policy_summary", "LOGGER", "WEAK_COMBINATIONS",
           "warn_at_caller", "weak_combination"]

#: the logger qstate reports on (the first step's state summary, at INFO)
LOGGER = logging.getLogger("qstate")

#: plain state dtypes by the ``state_format`` that names them
_PLAIN_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class FormatNbytes:
    """The states of one format on this rank: how many, their elements, the bytes they hold, and the
    bytes float32 states of as many elements would hold."""

    states: int
    elements: int
    storage_nbytes: int
    fp32_nbytes: int


@dataclass(frozen=True)
class StateNbytes:
    """An optimizer's state bytes on this rank, by format (``"8bit"``, ``"4bit"``, ``"fp8"``, ``"fp32"``,
    ``"bf16"``: the ``state_format`` names; :class:`FormatNbytes` each), with the totals."""

    formats: dict[str, FormatNbytes]

    @property
    def storage_nbytes(self) -> int:
        return sum(f.storage_nbytes for f in self.formats.values())

    @property
    def fp32_nbytes(self) -> int:
        return sum(f.fp32_nbytes for f in self.formats.values())

    def __str__(self) -> str:
        parts = [f"{name}: {f.states} states, {f.elements:,} elements, {f.storage_nbytes:,} bytes"
                 for name, f in sorted(self.formats.items())]
        share = f" ({100 * self.storage_nbytes / self.fp32_nbytes:.1f}%)" if self.fp32_nbytes else ""
        return (f"{'; '.join(parts) or 'no states'}; {self.storage_nbytes:,} bytes on this rank against "
                f"{self.fp32_nbytes:,} in float32{share}")


def _format_of(local: Tensor) -> str:
    if isinstance(local, QuantizedState):
        return local.format
    return _PLAIN_NAMES.get(local.dtype, str(local.dtype).replace("torch.", ""))


def count_nbytes(states: Iterable[Tensor]) -> StateNbytes:
    """:class:`StateNbytes` of ``states`` (plain tensors, :class:`~qstate.QuantizedState`, DTensors over
    either: their local shards)."""
    counts: dict[str, list[int]] = {}
    for state in states:
        local = local_of(state)
        c = counts.setdefault(_format_of(local), [0, 0, 0])
        c[0] += 1
        c[1] += local.numel()
        c[2] += local_nbytes(state)
    return StateNbytes({name: FormatNbytes(n, elements, nbytes, 4 * elements)
                        for name, (n, elements, nbytes) in counts.items()})


def policy_summary(name: str, planned: Iterable[tuple[str, Optional[str], int]], nbytes: StateNbytes) -> str:
    """The first step's record: ``planned`` holds, per parameter, the format its states get, why they
    stayed plain though the group asked for a quantized format (or None), and how many states it keeps."""
    formats: Counter = Counter()
    reasons: Counter = Counter()
    params = 0
    for fmt, reason, n in planned:
        params += 1
        formats[fmt] += n
        if reason is not None:
            reasons[reason] += n
    total = sum(formats.values())
    text = f"{name}: {total} states of {params} parameters: " + ", ".join(
        f"{n} {fmt}" for fmt, n in sorted(formats.items()))
    if reasons:
        stayed = sum(reasons.values())
        text += f"; {stayed} states of {total} stayed fp32: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(reasons.items()))
    return f"{text}; {nbytes}"


#: (update rule, state format) -> why the combination is weak, warned once per optimizer (measured in
#: ``benchmarks/RESULTS.md``)
WEAK_COMBINATIONS = {
    ("lion", "4bit"): ("Lion's slow momentum (m <- 0.99 m + 0.01 g) accumulates 4-bit rounding noise: 4bit Lion "
                       "ends measurably above fp32 Lion where 8bit stays close (benchmarks/RESULTS.md); use "
                       "state_format='8bit' for Lion"),
}


def weak_combination(name: str, rule: str, fmt: str) -> Optional[str]:
    """The warning for ``name``'s update ``rule`` with ``fmt`` states, if the combination is documented weak."""
    why = WEAK_COMBINATIONS.get((rule, fmt))
    return None if why is None else f"{name}: state_format={fmt!r} is a weak combination: {why}"


#: frames in these directories are the optimizer's construction, not its caller
_INSIDE = (str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(torch.optim.__file__).parent))


def warn_at_caller(message: str) -> None:
    """``warnings.warn(message)`` attributed to the first frame outside qstate and ``torch.optim`` (the line
    that built the optimizer or added the group)."""
    frame, level = sys._getframe(1), 2  # stacklevel 1 is this function, 2 its caller
    while frame is not None and str(pathlib.Path(frame.f_code.co_filename).resolve()).startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)

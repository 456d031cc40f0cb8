"""The C kernel's encode and decode of CPU states (``copy_``, :func:`qstate.quantize`, ``dequantize``).

An encode is an update rule run by the C kernel: :data:`WRITE` has one state and the math
``(p, [g])``, and runs with the values as both ``p`` and ``g``. Its generated C returns ``p`` as it is
(``RULE_KEEPS_PARAM``: the values are never written) and sets the state to ``g``, which the kernel
encodes as the formats do (its contract with :meth:`~qstate.formats.BlockFormat.encode`): the same
codes and scales, bit for bit. A decode is the same kernel's ``qstate_decode``: the values the update
reads, ``qmap[code] * scale``. Both take states of the kinds the C kernel supports that carry their
format's map (an encode: rounded to nearest, from float32 or bfloat16 values); any other call keeps
the formats' torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._state import QuantizedState
from .._state_kernels import register_state_kernels
from . import _cpu_kernel
from ._codec import get_codec
from ._kernels import KernelSpec
from .rules import StateSpec, UpdateRule, register_rule
from ._state_kind import StateKind

__all__ = ["WRITE", "CPUStateKernels"]


def _write(p: Tensor, g: Tensor, states: list, h: dict, flags: dict) -> tuple[Tensor, list[Tensor]]:
    return p, [g]


#: the state set to the values (``g``), the parameter (the same values) kept
WRITE = register_rule(UpdateRule(name="qstate.write", states=lambda flags: (StateSpec("values", True),),
                                 scalar_names=("lr", "grad_unscale"), scalars=lambda group, step: {},
                                 math=_write))
_HYPER = (0.0, 1.0)


def _spec(q: QuantizedState, dtype: torch.dtype) -> KernelSpec:
    return KernelSpec(WRITE.name, (), dtype, False, (StateKind.of(q),), "cpu")


def _takes(q: QuantizedState, dtype: torch.dtype) -> bool:
    if type(q) is not QuantizedState or not get_codec(q.format, q.signed, "cpu").matches(q.qmap):
        return False
    return _cpu_kernel.supports(_spec(q, dtype), q.codes.device, dtype)


class CPUStateKernels:
    """:class:`qstate._state_kernels.StateKernels` of CPU states: the C kernel (module docstring)."""

    def encodes(self, q: QuantizedState, values: Tensor) -> bool:
        # the values' dtype: the kernel spec's parameter dtype, which _cpu_kernel.supports checks
        return q.rounding == "nearest" and values.device.type == "cpu" and _takes(q, values.dtype)

    def encode_into(self, q: QuantizedState, values: Tensor) -> None:
        x = values.detach().contiguous().view(-1)
        if type(x) is not Tensor:
            x = x.as_subclass(Tensor)
        _cpu_kernel.run_once(_spec(q, values.dtype), x, x, [q], _HYPER)
        torch.autograd.graph.increment_version([q.codes, q.scale])

    def decodes(self, q: QuantizedState) -> bool:
        return _takes(q, torch.float32)

    def decode(self, q: QuantizedState) -> Tensor:
        return _cpu_kernel.decode_once(_spec(q, torch.float32), q)


register_state_kernels("cpu", CPUStateKernels())

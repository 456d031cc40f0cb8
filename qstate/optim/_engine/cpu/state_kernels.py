"""The C kernel's encode and decode of CPU states (``copy_``, :func:`qstate.quantize`, ``dequantize``).

An encode is the update rule :data:`WRITE` (one state, math ``(p, [g])``) run with the values as both
``p`` and ``g``: its C keeps ``p`` (``RULE_KEEPS_PARAM``: the values are never written) and encodes
``g`` into the state as the formats do, the same codes and scales bit for bit. A decode is
``qstate_decode``: ``qmap[code] * scale``, the values the update reads. Both take states the C kernel
supports that carry their format's map (an encode: rounded to nearest, from float32 or bfloat16
values) while the backends pick the C kernel; any other call keeps the formats' torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...._state import QuantizedState
from ..backends import backend_for
from . import kernel as c_kernel
from ....formats._codec import get_codec
from ...rules import StateSpec, UpdateRule, register_rule
from ..spec import KernelSpec, StateKind

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
    # the C kernel where the backends pick it (cpu_kernel_enabled switches it off for writes too)
    return backend_for(_spec(q, dtype), q.codes.device.type, dtype) is c_kernel.C_KERNEL


class CPUStateKernels:
    """:class:`qstate._state_kernels.StateKernels` of CPU states: the C kernel (module docstring)."""

    def encodes(self, q: QuantizedState, values: Tensor) -> bool:
        # the values' dtype: the kernel spec's parameter dtype, which the C kernel's supports checks
        return q.rounding == "nearest" and values.device.type == "cpu" and _takes(q, values.dtype)

    def encode_into(self, q: QuantizedState, values: Tensor) -> None:
        x = values.detach().contiguous().view(-1)
        if type(x) is not Tensor:
            x = x.as_subclass(Tensor)
        c_kernel.run_once(_spec(q, values.dtype), x, x, [q], _HYPER)
        torch.autograd.graph.increment_version([q.codes, q.scale])

    def decodes(self, q: QuantizedState) -> bool:
        return _takes(q, torch.float32)

    def decode(self, q: QuantizedState) -> Tensor:
        return c_kernel.decode_once(_spec(q, torch.float32), q)


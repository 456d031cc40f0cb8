"""The C kernel's encode and decode of CPU states (``copy_``, :func:`qstate.quantize`, ``dequantize``).

An encode is the update rule :data:`WRITE` (one state, math ``(p, [g])``) run with the values as both
``p`` and ``g``: its C keeps ``p`` (``RULE_KEEPS_PARAM``: the values are never written) and encodes
``g`` into the state as the formats do, the same codes and scales bit for bit. A decode is
``qstate_decode``: ``qmap[code] * scale``, the values the update reads. Both take states the C kernel
supports that carry their format's map (an encode: rounded to nearest, from float32 or bfloat16
values) while the backends pick the C kernel; any other call keeps the formats' torch ops.

They are also the CPU kernels of ``qstate::encode_into_`` and ``qstate::decode`` (:mod:`qstate._library`),
which compiled code calls: the arguments are checked as the ops' other kernels check them
(:func:`qstate._state_codec.check_codec_args`), then as a state (:func:`qstate._state.check_parts`, shapes
only) before the C kernel sees a buffer; a call the C kernel does not take runs the ops' torch kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...._state import QuantizedState, check_parts
from ...._state_codec import check_codec_args, decode_rows, encode_rows_into
from ..backends import backend_for
from . import kernel as c_kernel
from ....formats._codec import get_codec
from ...rules import StateSpec, UpdateRule, register_rule
from ..spec import KernelSpec, StateKind

__all__ = ["WRITE", "KERNELS", "CPUStateKernels", "decode_cpu", "encode_into_cpu"]


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
        # the values' dtype: the kernel spec's parameter dtype, which the C kernel's supports checks; its
        # rows hold the values with no padding (a 1-D state of several rows, from a cat, may have some)
        return (q.rounding == "nearest" and values.device.type == "cpu"
                and q.codes.shape[0] * q.row_len == q.numel() and _takes(q, values.dtype))

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


#: the C kernel's encode and decode of CPU states: the states' (``register_state_kernels``) and the ops' CPU
#: kernels' (:func:`encode_into_cpu`, :func:`decode_cpu`), registered by ``cpu/__init__.py``
KERNELS = CPUStateKernels()


def _state_of(op: str, codes: Tensor, scale: Tensor, qmap, format: str, signed: bool, block_size: int,
              row_len: int, values: Optional[Tensor] = None) -> QuantizedState:
    """The 1-D state over these parts, of ``values``' elements (else all the rows'), checked (shapes, dtypes,
    devices) as the ops' arguments and as a state."""
    check_codec_args(op, codes, scale, qmap, format, signed, block_size, row_len, values)
    numel = codes.shape[0] * row_len if values is None else values.numel()
    dtype = torch.float32 if values is None else values.dtype
    check_parts(codes, scale, qmap, format=format, signed=signed, block_size=block_size, row_len=row_len,
                shape=(numel,), dtype=dtype, rounding="nearest", values=False)
    return QuantizedState(codes, scale, qmap, format=format, signed=signed, block_size=block_size, row_len=row_len,
                          shape=(numel,), dtype=dtype)


def _whole(q: QuantizedState) -> bool:
    """Whether ``q``'s parts are contiguous, as the C kernel takes them (views of other layouts run the torch ops)."""
    return q.codes.is_contiguous() and q.scale.is_contiguous()


def encode_into_cpu(codes: Tensor, scale: Tensor, values: Tensor, qmap, format: str, signed: bool, block_size: int,
                     row_len: int) -> None:
    """``qstate::encode_into_`` on CPU: the C kernel where it takes the call, else the formats' torch ops."""
    q = _state_of("qstate::encode_into_", codes, scale, qmap, format, signed, block_size, row_len, values)
    if _whole(q) and q.rows * q.row_len == values.numel() and KERNELS.encodes(q, values):
        KERNELS.encode_into(q, values)
    else:
        encode_rows_into(codes, scale, values, qmap, format, signed, block_size, row_len)


def decode_cpu(codes: Tensor, scale: Tensor, qmap, format: str, signed: bool, block_size: int,
                row_len: int) -> Tensor:
    """``qstate::decode`` on CPU: the C kernel where it takes the call, else the formats' torch ops."""
    q = _state_of("qstate::decode", codes, scale, qmap, format, signed, block_size, row_len)
    if _whole(q) and KERNELS.decodes(q):
        return KERNELS.decode(q)
    return decode_rows(codes, scale, qmap, format, signed, block_size, row_len)

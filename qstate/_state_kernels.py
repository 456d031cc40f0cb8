"""Device kernels that encode values into a state and decode a state's values, registered by device type.

A :class:`~qstate.QuantizedState`'s ``dequantize``, ``copy_`` of values into a state and
:func:`qstate.quantize` run the formats' torch ops (:meth:`~qstate.formats.BlockFormat.encode` and
``decode``) unless the kernels registered for the state's device type take the call
(:meth:`StateKernels.encodes`, :meth:`StateKernels.decodes`); ``import qstate`` registers the C kernel's
for CPU states, and inductor's compiled encode and decode for CUDA states (:mod:`qstate._compiled_codec`).
Registered kernels write exactly the codes and scales the formats' encode writes and
read exactly the values their decode reads, and raise before writing anything when a buffer is not
what they take.

While ``torch.compile`` traces a state of a device type registered here with ``traced`` (CPU), its
encode and decode are the ops ``qstate::encode_into_`` and ``qstate::decode``
(:mod:`qstate._state_codec`), whose kernels for that device type are the same kernels (the C kernel's
module registers both); the compiled code calls them.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["StateKernels", "kernels_for", "register_state_kernels", "traced_codec"]


class StateKernels(Protocol):
    def encodes(self, q: Any, values: Tensor) -> bool:
        """Whether :meth:`encode_into` takes ``values`` (``q``'s shape, on ``q``'s device) for ``q``."""

    def encode_into(self, q: Any, values: Tensor) -> None:
        """Write ``values`` into ``q``'s codes and scales in place (``q``'s layout and rounding)."""

    def decodes(self, q: Any) -> bool:
        """Whether :meth:`decode` takes ``q``."""

    def decode(self, q: Any) -> Tensor:
        """``q``'s values: a new float32 tensor of ``q.rows * q.row_len`` elements."""


#: device type -> the kernels registered for states on it
_KERNELS: dict[str, StateKernels] = {}
#: device types whose kernels are also the kernels of ``qstate::encode_into_``/``qstate::decode``
_TRACED: set[str] = set()


def register_state_kernels(device_type: str, kernels: StateKernels, *, traced: bool = True) -> None:
    """Register ``kernels`` for states on ``device_type`` (replacing earlier ones). ``traced``: they are
    also the codec ops' kernels for the device type, which compiled code then calls (module docstring);
    else compiled code keeps the formats' torch ops."""
    _KERNELS[device_type] = kernels
    (_TRACED.add if traced else _TRACED.discard)(device_type)


def kernels_for(q: Any) -> Optional[StateKernels]:
    """The kernels registered for ``q``'s device type, if any; none for a fake, meta or subclass state, while
    tracing, or under a dispatch mode (the kernels read and write real buffers, outside torch's dispatch;
    there the formats' torch ops run)."""
    codes = q.codes
    if type(codes) is not Tensor or codes.is_meta or is_fake(codes) or torch.compiler.is_compiling() \
            or _get_current_dispatch_mode() is not None:
        return None
    return _KERNELS.get(codes.device.type)


def traced_codec(q: Any) -> bool:
    """Whether ``q``'s encode (rounded to nearest) and decode are the ops ``qstate::encode_into_`` and
    ``qstate::decode``: while ``torch.compile`` traces, for a state on a device type whose registered
    kernels are the ops' (``traced``; the traced graph then calls them). Elsewhere compiled code keeps the
    formats' torch ops, which the compiler fuses into its own kernels."""
    return torch.compiler.is_compiling() and q.codes.device.type in _TRACED

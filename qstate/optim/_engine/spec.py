"""The kind of one optimizer state: what a fused kernel is built for, never a shape or a value."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import math

import torch
from torch import Tensor

from ..._state import QuantizedState
from ...formats._codec import get_codec

__all__ = ["MAX_UNIT", "KernelSpec", "StateKind", "block_unit", "fusable"]


class StateKind(NamedTuple):
    """A plain state (``quantized=False``: its ``dtype``) or a :class:`~qstate.QuantizedState`
    (``format``, ``signed``, ``block_size``, ``rounding``). A named tuple: kernel specs
    (:class:`KernelSpec`) hold one per state and key the kernel caches with it.

    An optimizer's plan for a parameter (``QuantizedOptimizer.plan``) is a kind without
    ``signed``/``rounding``, which each of its states then sets."""

    quantized: bool
    dtype: Optional[torch.dtype] = None
    format: Optional[str] = None
    signed: Optional[bool] = None
    block_size: Optional[int] = None
    rounding: Optional[str] = None

    @classmethod
    def plain(cls, dtype: torch.dtype) -> "StateKind":
        return cls(False, dtype=dtype)

    @classmethod
    def quantized_as(cls, format: str, block_size: int, signed: Optional[bool] = None,
                     rounding: Optional[str] = None) -> "StateKind":
        return cls(True, format=format, signed=signed, block_size=block_size, rounding=rounding)

    @classmethod
    def of(cls, state: Tensor) -> "StateKind":
        """The kind of one state tensor (a DTensor state counts as plain: the kernels see its shards)."""
        if type(state) is QuantizedState:
            return cls.quantized_as(state.format, state.block_size, state.signed, state.rounding)
        return cls.plain(state.dtype)

    def tag(self) -> str:
        """A name for kernels of this kind (``q_8bit_True_256_nearest``, ``plain_float32``)."""
        if self.quantized:
            return f"q_{self.format}_{self.signed}_{self.block_size}_{self.rounding}"
        return f"plain_{str(self.dtype).replace('torch.', '')}"


class KernelSpec(NamedTuple):
    """A kernel spec: what one compiled graph (or C kernel) is built for, never a shape. A named tuple:
    it keys the kernel caches, and is built and looked up on every step that cannot reuse a call."""

    rule: str
    flags: tuple  # sorted (name, value) pairs of the rule's static flags
    param_dtype: torch.dtype
    stochastic_round: bool
    states: tuple[StateKind, ...]
    device_type: str

    @classmethod
    def of(cls, rule: str, flags: tuple, p: Tensor, states: Sequence[Tensor], stochastic_round: bool) -> "KernelSpec":
        """The kind of updating ``p`` and ``states`` (:meth:`StateKind.of` each; a DTensor state counts as plain)."""
        return cls(rule, flags, p.dtype, stochastic_round, tuple(StateKind.of(s) for s in states), p.device.type)

    @property
    def quantized(self) -> bool:
        return any(s.quantized for s in self.states)

    @property
    def keyed(self) -> bool:
        """Whether the spec draws by position under a key (:mod:`qstate.formats._rounding`): it writes a
        bfloat16 parameter or a state with stochastic rounding. Its kernels then take the key and each
        element's place (:func:`run_compiled`)."""
        return self.param_sr or any(s.rounding == "stochastic" for s in self.states)

    @property
    def param_sr(self) -> bool:
        """Whether the spec writes its bfloat16 parameter with stochastic rounding: its kernels then take
        the draws' key and place (:func:`run_compiled`)."""
        return self.stochastic_round and self.param_dtype == torch.bfloat16

    def tag(self) -> str:
        parts = [self.rule, str(self.param_dtype).split(".")[-1], "sr" if self.stochastic_round else "rn"]
        parts += [s.tag() for s in self.states]
        return "_".join(parts).replace("-", "_")


#: largest block-space column group (lcm of the states' block sizes) the fused kernels take
MAX_UNIT = 4096


def block_unit(block_sizes: Sequence[int]) -> int:
    """Elements per block-space column group: the lcm of the states' block sizes."""
    return math.lcm(*block_sizes)


def fusable(p: Tensor, g: Tensor, states: Sequence[Tensor]) -> bool:
    """Whether the fused kernels (the C kernel, inductor's) can run the update of ``p`` with ``g`` and
    ``states``: plain contiguous tensors of one shape and
    device, and plain states or float32 :class:`~qstate.QuantizedState` s of one row layout whose map
    is their format's (compared once, until the map's version counter moves) and whose rounding the
    format's codec implements. Anything else runs the rule's math op by op."""
    if type(p) not in (Tensor, torch.nn.Parameter) or type(g) is not Tensor:
        return False
    device, shape = p.device, p.shape
    if not (p.is_contiguous() and g.is_contiguous()) or g.shape != shape or g.device != device:
        return False
    if not states:
        return True
    state_type = type(states[0])
    if state_type is Tensor:
        return all(type(s) is Tensor and s.device == device and s.shape == shape and s.is_contiguous()
                   for s in states)
    if state_type is not QuantizedState:
        return False
    layout = (states[0].rows, states[0].row_len)
    if layout[0] * layout[1] != p.numel():
        return False
    for s in states:  # one row layout, one block space
        if type(s) is not QuantizedState or s.device != device or s.dtype != torch.float32:
            return False
        if (s.rows, s.row_len) != layout or not (s.codes.is_contiguous() and s.scale.is_contiguous()):
            return False
        codec = get_codec(s.format, s.signed, device)
        if not (codec.matches(s.qmap) and codec.supports(s.rounding)):
            return False
    return block_unit([s.block_size for s in states]) <= MAX_UNIT

"""The kind of one optimizer state: what a fused kernel is built for, never a shape or a value."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .._state import QuantizedState

__all__ = ["StateKind"]


class StateKind(NamedTuple):
    """A plain state (``quantized=False``: its ``dtype``) or a :class:`~qstate.QuantizedState`
    (``format``, ``signed``, ``block_size``, ``rounding``). A named tuple: kernel specs
    (``_kernels.KernelSpec``) hold one per state and key the kernel caches with it.

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


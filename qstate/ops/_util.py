"""Helpers shared by the op handlers."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from .._state import QuantizedState

aten = torch.ops.aten


def dequantize_args(args: Any) -> Any:
    """``args`` with every QuantizedState replaced by its dequantized values."""
    return tree_map(lambda x: x.dequantize() if isinstance(x, QuantizedState) else x, args)


def check_same_kind(what: str, a: QuantizedState, b: QuantizedState) -> None:
    """Raise unless ``a`` and ``b`` share format, signedness, block size, rounding and dtype."""
    if (a.kind(), a.dtype) != (b.kind(), b.dtype):
        raise ValueError(f"{what}: expected a state of kind [{a.describe()}], got [{b.describe()}]")


def is_dim0(dim: int, q: QuantizedState) -> bool:
    """Whether ``dim`` (negative counts from the end) is dim 0 of ``q``."""
    return (dim + max(q.dim(), 1) if dim < 0 else dim) == 0


def check_dim0(dim: int, what: str, q: QuantizedState) -> None:
    """Raise unless ``dim`` is dim 0 of ``q`` (``what``: the op, for the message)."""
    if not is_dim0(dim, q):
        raise NotImplementedError(f"{what}: a QuantizedState supports dim 0 only, got dim={dim} for [{q.describe()}]")

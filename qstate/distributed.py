"""DTensor entry points (filled in by the quantized-states-in-DTensor work)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["is_dtensor", "quantize_dtensor", "zeros_like_dtensor"]


def is_dtensor(x: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(x, DTensor)


def quantize_dtensor(x: Tensor, fmt: str, **kwargs: Any) -> Tensor:
    raise NotImplementedError("quantize: DTensor inputs are not supported yet")


def zeros_like_dtensor(p: Tensor, fmt: str, **kwargs: Any) -> Tensor:
    raise NotImplementedError("zeros_like: DTensor inputs are not supported yet")

"""Quantized states inside DTensor.

A quantized DTensor state is a DTensor whose local tensor is a
:class:`~qstate.QuantizedState` holding this rank's shard. Rules:

* Placements are ``Replicate()`` or ``Shard(0)`` on every mesh dim; dim-0
  shards are whole rows of the state (blocks never cross rows), so uneven
  ``Shard(0)`` (first dim not divisible by the world size) pads, gathers and
  reshards by moving rows, never requantizing. ``Partial`` and other shard
  dims are rejected.
* The local state lives on the local tensor's device, which may differ from
  the mesh's device type (FSDP2 ``CPUOffloadPolicy``): then the DTensor is
  built directly from its spec, since ``from_local`` would move it.
* :func:`state_like` decides quantize-or-plain from the GLOBAL shape
  (``p.numel()``, ``p.ndim``), so every rank holds the same type.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ._api import quantize, zeros_like
from ._dtensor import is_dtensor, is_quantized_state, local_of, state_kind
from ._state import QuantizedState

__all__ = ["is_dtensor", "local_of", "local_nbytes", "is_quantized_state", "state_kind", "quantize_dtensor",
           "zeros_like_dtensor", "state_like", "wants_quantized", "DEFAULT_MIN_QUANTIZE_NUMEL"]

#: tensors with fewer elements keep a plain fp32 state
DEFAULT_MIN_QUANTIZE_NUMEL = 4096


def local_nbytes(state: Tensor) -> int:
    """Bytes this rank holds for ``state``: ``storage_nbytes()`` if quantized, else ``numel * element_size``."""
    local = local_of(state)
    if isinstance(local, QuantizedState):
        return local.storage_nbytes()
    return local.numel() * local.element_size()


def _check_dtensor(x: Any, what: str) -> None:
    if not is_dtensor(x):
        raise TypeError(f"{what}: expected a DTensor, got {type(x).__name__}")


def quantize_dtensor(x: Tensor, fmt: str, **kwargs: Any) -> Tensor:
    """:func:`qstate.quantize` of a DTensor: a DTensor over quantized local shards."""
    _check_dtensor(x, "quantize_dtensor")
    return quantize(x, fmt, **kwargs)


def zeros_like_dtensor(p: Tensor, fmt: str, **kwargs: Any) -> Tensor:
    """:func:`qstate.zeros_like` of a DTensor: a DTensor with ``p``'s mesh and placements."""
    _check_dtensor(p, "zeros_like_dtensor")
    return zeros_like(p, fmt, **kwargs)


def wants_quantized(p: Tensor, min_quantize_numel: int = DEFAULT_MIN_QUANTIZE_NUMEL) -> bool:
    """The quantize-or-plain policy, from the global shape only (same answer on every rank).

    Quantized iff ``p.ndim >= 2`` and ``p.numel() >= min_quantize_numel``.
    1-D tensors (biases, norms) stay plain fp32 at any size: their FSDP2
    shards do not start on block boundaries, and a plain state keeps them
    exact under any resharding.
    """
    return p.dim() >= 2 and p.numel() >= min_quantize_numel


def state_like(
    p: Tensor,
    fmt: str,
    *,
    signed: bool = True,
    block_size: Optional[int] = None,
    min_quantize_numel: int = DEFAULT_MIN_QUANTIZE_NUMEL,
    rounding: str = "nearest",
) -> Tensor:
    """A zero optimizer state for ``p``: quantized per :func:`wants_quantized`, else fp32 plain.

    ``p`` may be a plain tensor or a DTensor; the state has ``p``'s device
    (and mesh/placements). The quantized state's appearance dtype is
    ``p.dtype`` when that is float32/bfloat16, else float32; ``rounding`` is
    the quantized state's rounding mode (see :func:`qstate.quantize`).
    """
    if not wants_quantized(p, min_quantize_numel):
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    dtype = p.dtype if p.dtype in (torch.float32, torch.bfloat16) else torch.float32
    return zeros_like(p, fmt, signed=signed, block_size=block_size, dtype=dtype, rounding=rounding)

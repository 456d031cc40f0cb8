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

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local_of", "local_nbytes", "is_quantized_state", "state_kind", "quantize_dtensor", "zeros_like_dtensor", "state_like", "wants_quantized",
           "DEFAULT_MIN_QUANTIZE_NUMEL"]

#: tensors with fewer elements keep a plain fp32 state
DEFAULT_MIN_QUANTIZE_NUMEL = 4096


@functools.cache
def _dtensor_type() -> Optional[type]:
    """``DTensor``, or ``None`` in a torch built without distributed (imported once: asked every step)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(x: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def local_of(t: Tensor) -> Tensor:
    """This rank's tensor: a DTensor's local tensor, or ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def local_nbytes(state: Tensor) -> int:
    """Bytes this rank holds for ``state``: ``storage_nbytes()`` if quantized, else ``numel * element_size``."""
    from ._state import QuantizedState

    local = local_of(state)
    if isinstance(local, QuantizedState):
        return local.storage_nbytes()
    return local.numel() * local.element_size()


def is_quantized_state(t: Tensor) -> bool:
    """Whether ``t`` is a :class:`~qstate.QuantizedState` or a DTensor over one."""
    return isinstance(local_of(t), _quantized_state_type())


@functools.cache
def _quantized_state_type() -> type:
    from ._state import QuantizedState  # not at import time: _state imports this module

    return QuantizedState


def rounds_stochastically(t: Tensor) -> bool:
    """Whether ``t`` is a quantized state with stochastic rounding (a :class:`~qstate.QuantizedState`,
    or a DTensor over one, a simulated rank's ``LocalTensor`` included)."""
    state_type = _quantized_state_type()
    if type(t) is state_type:  # asked for every state every step: the common case first
        return t.rounding == "stochastic"
    local = local_of(t)
    shards = getattr(local, "_local_tensors", None)  # a LocalTensor: every simulated rank's shard
    if isinstance(shards, dict) and shards:
        local = next(iter(shards.values()))
    return isinstance(local, state_type) and local.rounding == "stochastic"


def state_kind(t: Tensor) -> str:
    """``"<format> <signed|unsigned> block_size=<n>"`` or ``"plain <dtype>"`` of a state, DTensor or not.

    A stochastically rounded state adds ``" rounding=stochastic"``
    (:meth:`QuantizedState.kind`). The kind of a DTensor state is its local
    tensor's (the same on every rank, see :func:`state_like`).
    """
    from ._state import QuantizedState

    local = local_of(t)
    if isinstance(local, QuantizedState):
        return local.kind()
    return f"plain {local.dtype}"


def _map_local(local: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` of this rank's shard (of every simulated rank's under LocalTensorMode)."""
    try:
        from torch.distributed._local_tensor import LocalTensor, tensor_map
    except ImportError:  # torch without simulated ranks
        return fn(local)
    if isinstance(local, LocalTensor):
        return tensor_map(local, lambda rank, shard: fn(shard))
    return fn(local)


def _check_placements(x: Tensor, what: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for p in x.placements:
        if not (type(p) is Replicate or (type(p) is Shard and p.dim == 0)):
            raise NotImplementedError(
                f"{what}: a quantized DTensor state must be Replicate() or Shard(0) on every mesh dim, "
                f"got placements {tuple(x.placements)} for shape {tuple(x.shape)}"
            )


def wrap_local_state(local: Tensor, like: Tensor) -> Tensor:
    """A DTensor with ``like``'s mesh, placements, shape and stride over ``local``."""
    from torch.distributed.tensor import DTensor

    mesh = like.device_mesh
    if local.device.type == mesh.device_type or local.is_meta:
        return DTensor.from_local(local, mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    # local device differs from the mesh's (CPU offload): from_local would move it
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(like.placements),
                       tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def quantize_dtensor(x: Tensor, fmt: str, **kwargs: Any) -> Tensor:
    from ._api import quantize

    _check_placements(x, "quantize")
    return wrap_local_state(_map_local(x.to_local(), lambda t: quantize(t, fmt, **kwargs)), x)


def zeros_like_dtensor(p: Tensor, fmt: str, **kwargs: Any) -> Tensor:
    from ._api import zeros_like

    _check_placements(p, "zeros_like")
    return wrap_local_state(_map_local(p.to_local(), lambda t: zeros_like(t, fmt, **kwargs)), p)


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
    from ._api import zeros_like

    if not wants_quantized(p, min_quantize_numel):
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    dtype = p.dtype if p.dtype in (torch.float32, torch.bfloat16) else torch.float32
    return zeros_like(p, fmt, signed=signed, block_size=block_size, dtype=dtype, rounding=rounding)

"""Helpers that look through DTensor (and simulated ranks' ``LocalTensor``) wrappers: whether a
tensor is a DTensor, its local tensor, whether it holds a :class:`~qstate.QuantizedState` and of
which kind, and a DTensor over a local state.

Imports only :class:`~qstate.QuantizedState` of qstate: the package's own modules (``qstate._api``,
the optimizers' step, checkpointing) ask here, and :mod:`qstate.distributed` exports them to users."""

from __future__ import annotations

import functools
from typing import Any, Optional

from torch import Tensor

from ._state import QuantizedState

__all__ = ["dtensor_type", "is_dtensor", "local_of", "shard_of", "is_quantized_state", "rounds_stochastically",
           "state_kind", "wrap_local_state"]


@functools.cache
def dtensor_type() -> Optional[type]:
    """``DTensor``, or ``None`` in a torch built without distributed (imported once: asked every step)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(x: Any) -> bool:
    cls = dtensor_type()
    return cls is not None and isinstance(x, cls)


def local_of(t: Tensor) -> Tensor:
    """This rank's tensor: a DTensor's local tensor, or ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def shard_of(t: Tensor) -> Tensor:
    """One rank's tensor: :func:`local_of`, and under simulated ranks the first rank's shard of the
    ``LocalTensor`` (every rank's shard has the same type and kind)."""
    local = local_of(t)
    shards = getattr(local, "_local_tensors", None)  # a LocalTensor: every simulated rank's shard
    if isinstance(shards, dict) and shards:
        return next(iter(shards.values()))
    return local


def is_quantized_state(t: Tensor) -> bool:
    """Whether ``t`` is a :class:`~qstate.QuantizedState` or a DTensor over one (a simulated rank's
    ``LocalTensor`` included)."""
    return isinstance(shard_of(t), QuantizedState)


def rounds_stochastically(t: Tensor) -> bool:
    """Whether ``t`` is a quantized state with stochastic rounding (a :class:`~qstate.QuantizedState`,
    or a DTensor over one, a simulated rank's ``LocalTensor`` included)."""
    if type(t) is QuantizedState:  # asked for every state every step: the common case first
        return t.rounding == "stochastic"
    local = shard_of(t)
    return isinstance(local, QuantizedState) and local.rounding == "stochastic"


def state_kind(t: Tensor) -> str:
    """``"<format> <signed|unsigned> block_size=<n>"`` or ``"plain <dtype>"`` of a state, DTensor or not.

    A stochastically rounded state adds ``" rounding=stochastic"``
    (:meth:`QuantizedState.kind`). The kind of a DTensor state is its local
    tensor's (the same on every rank, see :func:`qstate.distributed.state_like`).
    """
    local = local_of(t)
    if isinstance(local, QuantizedState):
        return local.kind()
    return f"plain {local.dtype}"


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

"""DTensor helpers below every qstate module: whether a tensor is a DTensor, its local tensor, a
DTensor over a local state, and a quantized DTensor state made shard by shard. Imports nothing of
qstate (:mod:`qstate._api` builds quantized DTensors with them, :mod:`qstate.distributed` exports
them)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from torch import Tensor

__all__ = ["dtensor_type", "is_dtensor", "local_of", "wrap_local_state", "state_on_shards"]


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
    """Raise unless every placement of ``x`` is one a quantized DTensor state may have:
    ``Replicate()`` or ``Shard(0)``."""
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


def state_on_shards(x: Tensor, what: str, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """The DTensor with ``x``'s mesh, placements, shape and stride over ``fn`` of ``x``'s local tensor
    (of every simulated rank's): a quantized state made shard by shard. Raises ``NotImplementedError``
    naming ``what`` unless every placement of ``x`` is ``Replicate()`` or ``Shard(0)``."""
    _check_placements(x, what)
    return wrap_local_state(_map_local(x.to_local(), fn), x)

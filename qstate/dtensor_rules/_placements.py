"""Pure-Python placement arithmetic shared by the rules.

Nothing here touches tensors, so it is safe to call from inside sharding
propagation (which may run under ``LocalTensorMode`` or ``FakeTensorMode``).

Invariant: :func:`local_range` reproduces DTensor's ``torch.chunk`` layout:
``Shard(d)`` over ``n`` ranks gives rank ``i`` the elements
``[i * c, min((i + 1) * c, size))`` with ``c = ceil(size / n)`` (empty past
the end), applied mesh dim by mesh dim in the spec's shard order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, Shard

try:  # torch >= 2.6
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = ()  # type: ignore[assignment,misc]


__all__ = [
    "chunk_range",
    "is_shard_like",
    "local_range",
    "mesh_coordinates",
    "mesh_dims_sharding",
    "spec_with",
]


def is_shard_like(p: Placement) -> bool:
    """``Shard`` or ``_StridedShard`` (the latter is not a ``Shard`` subclass)."""
    return isinstance(p, Shard) or (
        bool(_StridedShard) and isinstance(p, _StridedShard)  # type: ignore[arg-type]
    )


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of chunk ``index`` of ``torch.chunk(range(size), num_chunks)``."""
    chunk = -(-size // num_chunks) if size else 0
    start = min(index * chunk, size)
    return start, min(start + chunk, size) - start


def mesh_dims_sharding(spec: DTensorSpec, tensor_dim: int) -> list[int]:
    """Mesh dims that shard ``tensor_dim``, in the order the shards are applied."""
    order = getattr(spec, "shard_order", None)
    if order:
        for entry in order:
            if entry.tensor_dim == tensor_dim:
                return list(entry.mesh_dims)
        return []
    return [
        m
        for m, p in enumerate(spec.placements)
        if is_shard_like(p) and p.dim == tensor_dim  # type: ignore[attr-defined]
    ]


def local_range(
    size: int,
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    mesh_dims: Sequence[int],
) -> tuple[int, int]:
    """``(global offset, length)`` of the contiguous block a rank holds of one dim.

    Only valid when every placement in ``mesh_dims`` is a plain ``Shard``.
    """
    offset, length = 0, size
    for m in mesh_dims:
        o, length = chunk_range(length, mesh_shape[m], coordinate[m])
        offset += o
    return offset, length


def mesh_coordinates(mesh_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every rank coordinate of a mesh of this shape."""
    return itertools.product(*(range(s) for s in mesh_shape))


def spec_with(
    spec: DTensorSpec, placements: tuple[Placement, ...], meta: TensorMeta | None
) -> DTensorSpec:
    """``spec`` with new placements/meta; the shard order survives if placements do."""
    kwargs = {}
    if placements == tuple(spec.placements):
        for field in ("shard_order", "use_strided_shard_as_shard_order"):
            if getattr(spec, field, None) is not None:
                kwargs[field] = getattr(spec, field)
    return DTensorSpec(spec.mesh, placements, tensor_meta=meta, **kwargs)

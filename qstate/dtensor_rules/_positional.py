"""qstate's positional values on DTensors: ``qstate::flat_index_like`` and :func:`positional_randint_like`.

``flat_index_like(x)`` holds each element's row-major index in the full tensor, which the
optimizers' stochastic rounding hashes; on a DTensor every rank computes its shard's indices from
its place (uneven, empty and strided shards included; ``Partial`` mesh dims become ``Replicate``):
no collectives. :func:`positional_randint_like` hashes those indices with one key per call::

    bits(i) = splitmix64(key + (i + 1) * GAMMA)

with ``key`` drawn from the generator (``generator=``, else the default generator of ``x``'s
device) as ``torch.empty((), dtype=torch.int64).random_(generator=generator)`` draws it, so a shard
holds the same slice of the values the full tensor would, and replicas agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from qstate import _random
from qstate._library import flat_index_like
from qstate.dtensor_rules import _compat
from qstate.dtensor_rules._placements import mesh_dims_sharding
from qstate.dtensor_rules._registry import Rule

__all__ = ["QSTATE_OP_RULES", "flat_index_like_handler", "mix64", "positional_randint_like"]

_MASK63 = (1 << 63) - 1


def _xor_lsr_(z: torch.Tensor, s: int) -> torch.Tensor:
    """``z ^= z >>> s`` on int64 (a logical shift: torch's is arithmetic)."""
    return z.bitwise_xor_(torch.bitwise_right_shift(z, s).bitwise_and_((1 << (64 - s)) - 1))


def mix64(key: Any, index: torch.Tensor) -> torch.Tensor:
    """splitmix64 output ``index`` of the stream seeded with ``key`` (int64, wraps): :mod:`qstate._random`'s
    ``mix(key + (index + 1) * GAMMA)``, as int64."""
    z = (index + 1).mul_(_random.as_int64(_random.GAMMA)).add_(key)
    _xor_lsr_(z, 30).mul_(_random.as_int64(_random.MIX1))
    _xor_lsr_(z, 27).mul_(_random.as_int64(_random.MIX2))
    return _xor_lsr_(z, 31)


def _dtype_bounds(dtype: torch.dtype) -> tuple[int, int]:
    if dtype == torch.bool:
        return 0, 1
    if dtype.is_floating_point:
        return -int(torch.finfo(dtype).max), int(torch.finfo(dtype).max)
    return int(torch.iinfo(dtype).min), int(torch.iinfo(dtype).max)


def positional_randint_like(input: torch.Tensor, low: int = 0, high: int | None = None, *,
                            dtype: torch.dtype | None = None, generator: torch.Generator | None = None
                            ) -> torch.Tensor:
    """``torch.randint_like`` from the positional stream, on a plain tensor or a DTensor (whose shards
    hold the slices of the full tensor's values): uniform in ``[low, high)`` (``[0, low)`` when
    ``high`` is None), up to a modulo bias below ``(high - low) / 2**63``."""
    if high is None:
        low, high = 0, low
    dtype = dtype or input.dtype
    lowest, highest = _dtype_bounds(dtype)
    if not (lowest <= low < high and high - 1 <= highest and high - low <= 1 << 63):
        raise ValueError(f"positional_randint_like: [low, high) = [{low}, {high}) must be a non-empty range of "
                         f"at most 2**63 {dtype} values")
    if generator is not None:  # one object shared by simulated ranks: one draw
        with _compat.local_tensor_mode_disabled():
            key = torch.empty((), dtype=torch.int64, device=generator.device).random_(generator=generator)
    else:  # the default generator is per rank (per simulated rank under LocalTensorMode)
        key = torch.empty((), dtype=torch.int64, device=input.device).random_()
    bits = mix64(key.to(input.device), flat_index_like(input))
    return bits.bitwise_and_(_MASK63).remainder_(high - low).add_(low).to(dtype)


# -------------------------------------------------------------- flat_index_like on DTensors
def _split_1d(vec: torch.Tensor, p: Placement, num_chunks: int, index: int) -> torch.Tensor:
    """The part of a 1-D index vector that ``p`` gives to chunk ``index``."""
    split_factor = getattr(p, "split_factor", None)
    one_d = Shard(0) if split_factor is None else type(p)(0, split_factor=split_factor)
    return one_d._split_tensor(vec, num_chunks, with_padding=False, contiguous=True)[0][index]


def _fill_index(local: torch.Tensor, shape: Sequence[int], placements: Sequence[Placement],
                mesh_shape: Sequence[int], coordinate: Sequence[int], orders: Sequence[Sequence[int]]
                ) -> torch.Tensor:
    """Per rank: ``local`` (int64) filled with its elements' row-major indices in the full tensor."""
    index = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = 1
    for d in reversed(range(len(shape))):
        vec = torch.arange(shape[d], dtype=torch.int64, device=local.device)
        for m in orders[d]:
            vec = _split_1d(vec, placements[m], mesh_shape[m], coordinate[m])
        index = index + vec.view([-1 if e == d else 1 for e in range(len(shape))]) * stride
        stride *= shape[d]
    if tuple(index.shape) != tuple(local.shape):
        raise AssertionError(f"local shard {tuple(local.shape)} does not match its placements {tuple(placements)} "
                             f"(expected {tuple(index.shape)})")
    return local.copy_(index)


_fill_index_per_rank = _compat.run_per_rank(_fill_index)


def flat_index_like_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``qstate::flat_index_like`` on a DTensor: each rank fills its shard from its place."""
    from torch.distributed.tensor import DTensor

    self = args[0] if args else kwargs["self"]
    spec: DTensorSpec = self._spec
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    local = torch.empty_like(self._local_tensor, dtype=torch.int64, memory_format=torch.contiguous_format)
    coordinate = spec.mesh.get_coordinate()
    if coordinate is not None:  # ranks outside the mesh hold an empty shard
        orders = [mesh_dims_sharding(spec, d) for d in range(self.ndim)]
        local = _fill_index_per_rank(local, tuple(self.shape), placements, tuple(spec.mesh.shape), coordinate,
                                     orders)
    contiguous = torch.empty(tuple(self.shape), device="meta").stride()
    meta = TensorMeta(self.shape, contiguous, torch.int64)
    return DTensor(local, DTensorSpec(spec.mesh, placements, tensor_meta=meta), requires_grad=False)


#: qstate's own op (registered by ``import qstate``)
QSTATE_OP_RULES: tuple[Rule, ...] = (
    Rule(op=flat_index_like, form="handler", impl=flat_index_like_handler,
         reason="qstate's flat_index_like: each shard's indices in the full tensor, from its place "
                "(stochastic rounding's draws on any layout; no collectives)"),
)

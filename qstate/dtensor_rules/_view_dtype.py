"""``aten.view.dtype`` (reinterpret the bytes as another dtype): a local view, or an error.

``x.view(dtype)`` keeps every dim but the last, which scales by ``src.itemsize / dst.itemsize``.
A view aliases its input, so the rule never redistributes: every rank views its own shard, and
an input no local view can describe raises (as DTensor's other view ops do) instead of being
all-gathered or all-reduced into a copy:

* ``Replicate``, ``Shard(d)`` for d not last, and ``Shard(last)`` of an unchanged itemsize stay;
* ``Shard(last)`` with a size change stays when every rank's local byte range is the
  ``torch.chunk`` byte range of its output shard, and raises otherwise (uneven widths, a
  ``_StridedShard``, an empty shard viewed as a wider dtype);
* ``Partial(op)`` stays for the identity view and for ``sum`` between integer dtypes of one width
  (two's complement reinterpretation is a ring isomorphism of Z/2^k); any other ``Partial``
  raises: the bits of a reduction are not the reduction of the bits.

``dtype`` is in the sharding cache key (``static_argnum=1``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, StrategyType
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from qstate.dtensor_rules import _probe
from qstate.dtensor_rules._dtypes import is_integer
from qstate.dtensor_rules._placements import local_range, mesh_coordinates, mesh_dims_sharding
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "view_commutes_with_reduction", "view_dtype_strategy"]

aten = torch.ops.aten


def view_commutes_with_reduction(p: Placement, src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``reduce(view(x_i)) == view(reduce(x_i))`` for every input."""
    if type(p) is not Partial:  # _MaskPartial & co carry rank-local state
        return False
    return src == dst or (p.reduce_op == "sum" and is_integer(src) and is_integer(dst)
                          and src.itemsize == dst.itemsize)


def _last_dim_shards_view(spec: DTensorSpec, dst: torch.dtype) -> bool:
    """Whether every rank's local view is its ``torch.chunk`` shard of the output's last dim."""
    meta = spec.tensor_meta
    src_size, dst_size, ndim = meta.dtype.itemsize, dst.itemsize, len(meta.shape)
    mesh_dims = mesh_dims_sharding(spec, ndim - 1) if ndim else []
    if src_size == dst_size or not mesh_dims:
        return True
    if any(not isinstance(spec.placements[m], Shard) for m in mesh_dims):
        return False  # a _StridedShard interleaves the last dim
    n_in = meta.shape[-1]
    n_out = n_in * src_size // dst_size
    for coordinate in mesh_coordinates(spec.mesh.shape):
        off_in, len_in = local_range(n_in, spec.mesh.shape, coordinate, mesh_dims)
        off_out, len_out = local_range(n_out, spec.mesh.shape, coordinate, mesh_dims)
        if (off_in * src_size, len_in * src_size) != (off_out * dst_size, len_out * dst_size):
            return False
        if dst_size > src_size and len_in == 0 and ndim > 1:
            return False  # a contiguous [.., 0] local has stride 1 on dim -2, which a wider dtype rejects
    return True


def view_dtype_strategy(op_schema: OpSchema) -> StrategyType:
    """Every input layout views locally to the same placements, or raises ``RuntimeError``."""
    input_strategy, dst = op_schema.args_schema[0], op_schema.args_schema[1]
    strategies = []
    for arg_strategy in input_strategy.strategies:
        spec = arg_strategy.output_spec
        meta = spec.tensor_meta
        for p in spec.placements:
            if isinstance(p, Partial) and not view_commutes_with_reduction(p, meta.dtype, dst):
                raise RuntimeError(
                    f"Cannot view a {p!r} DTensor of dtype {meta.dtype} as {dst}: the bits of a pending "
                    f"reduction are not the reduction of the bits. Please redistribute the tensor (e.g. to "
                    f"Replicate) before this operation.")
        if not _last_dim_shards_view(spec, dst):
            raise RuntimeError(
                f"Cannot view a DTensor with placements {spec.placements} and shape {tuple(meta.shape)} as "
                f"{dst}: the local last-dim shards of {meta.dtype} are not the torch.chunk shards of the "
                f"{dst} result. Please redistribute the tensor before this operation.")
        strategies.append(OpSpec(output_specs=DTensorSpec(spec.mesh, spec.placements), input_specs=(spec,),
                                 redistribute_cost=[[0.0] * len(input_strategy.strategies)]))
    return OpStrategy(strategies)


@_probe.checked
def torch_lacks_view_dtype_fix() -> bool:
    """Whether torch has no ``view.dtype`` rule, keeps a ``Partial(sum)`` through a float32 -> int32
    view, or leaves the dtype out of the sharding cache key (two views to other dtypes share it)."""
    op = aten.view.dtype
    if not _probe.has_rule(op):
        return True
    partial = _probe.spec((4,), torch.float32, [Partial()])
    if not isinstance(_probe.propagate(op, (partial, torch.int32)), Exception):
        return True
    replicate = _probe.spec((4,), torch.float32, [Replicate()])
    info = _probe.schema_info(op)
    return OpSchema(op, (replicate, torch.int32), {}, info) == OpSchema(op, (replicate, torch.int16), {}, info)


RULES: tuple[Rule, ...] = (
    Rule(op=aten.view.dtype, form="strategy", impl=view_dtype_strategy,
         schema_info=RuntimeSchemaInfo(static_argnum=1), needed=torch_lacks_view_dtype_fix,
         reason="view.dtype: a local view (dtype in the cache key) or an error; never a redistribution"),
)

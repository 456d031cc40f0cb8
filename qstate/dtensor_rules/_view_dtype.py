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


def _last_dim_error(spec: DTensorSpec, dst: torch.dtype) -> str | None:
    """Why the local views of ``spec``'s last-dim shards are not the output's ``torch.chunk`` shards
    (None: they are)."""
    meta = spec.tensor_meta
    src_size, dst_size, ndim = meta.dtype.itemsize, dst.itemsize, len(meta.shape)
    mesh_dims = mesh_dims_sharding(spec, ndim - 1) if ndim else []
    if src_size == dst_size or not mesh_dims:
        return None
    layout = f"a DTensor with placements {spec.placements} and shape {tuple(meta.shape)} from {meta.dtype} to {dst}"
    if any(not isinstance(spec.placements[m], Shard) for m in mesh_dims):
        return (f"Cannot view {layout}: a _StridedShard last dim has no contiguous byte ranges to reinterpret. "
                f"Please redistribute the tensor before this operation.")
    n_in = meta.shape[-1]
    n_out = n_in * src_size // dst_size
    ranges = [(local_range(n_in, spec.mesh.shape, c, mesh_dims), local_range(n_out, spec.mesh.shape, c, mesh_dims))
              for c in mesh_coordinates(spec.mesh.shape)]
    if any((a * src_size, n * src_size) != (b * dst_size, m * dst_size) for (a, n), (b, m) in ranges):
        return (f"Cannot view {layout}: the local last-dim shards are not (or, for a symbolic width, cannot be "
                f"shown to be) the torch.chunk shards of the result. Please redistribute the tensor before this "
                f"operation.")
    if dst_size > src_size and ndim > 1 and any(n == 0 for (_, n), _ in ranges):
        # a contiguous [.., 0] local has stride 1 on dim -2, which a wider dtype rejects
        return (f"Cannot view {layout}: some rank holds an empty last-dim shard, which cannot be viewed as a "
                f"wider dtype. Please redistribute the tensor before this operation.")
    return None


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
                    f"Cannot view a {p} DTensor of dtype {meta.dtype} as {dst}: the bits of a pending reduction "
                    f"are not the reduction of the bits. Please redistribute the tensor (e.g. to Replicate) "
                    f"before this operation.")
        error = _last_dim_error(spec, dst)
        if error is not None:
            raise RuntimeError(error)
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

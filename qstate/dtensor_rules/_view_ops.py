"""Sharding rule for ``aten.view.dtype`` (reinterpret the bytes as another dtype).

``x.view(dtype)`` keeps every dim but the last; the last dim scales by
``src.itemsize / dst.itemsize``.  Running it shard by shard is correct exactly
when each rank's local bytes are the bytes its output shard must hold:

* ``Replicate``                 -> ``Replicate``  (same bytes everywhere)
* ``Shard(d)``, d not last      -> ``Shard(d)``   (only the last dim rescales)
* ``Shard(last)``, same size    -> ``Shard(last)``
* ``Shard(last)``, size change  -> ``Shard(last)`` iff on every rank the local
  byte range ``[off * src, (off + n) * src)`` equals the ``torch.chunk`` byte
  range of the output; otherwise that mesh dim is redistributed to
  ``Replicate`` (with :class:`UnrepresentableShardWarning`).
* ``Partial(op)``               -> ``Replicate`` first: the bits of a reduction
  are not the reduction of the bits.  Exceptions: the identity view, and
  ``Partial(sum)`` between integer dtypes of one width (two's complement
  reinterpretation is a ring isomorphism of Z/2^k, so it commutes with sum).

Fixes W1 (``dtype`` missing from the sharding cache key), W2 (``Partial``
passed through) and W3/E4 (wrong local sizes for uneven last-dim shards).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    StrategyType,
)
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
)

from qstate.dtensor_rules import _compat, _probe
from qstate.dtensor_rules._placements import (
    is_shard_like,
    local_range,
    mesh_coordinates,
    mesh_dims_sharding,
    spec_with,
)
from qstate.dtensor_rules._registry import Rule


__all__ = [
    "RULES",
    "UnrepresentableShardWarning",
    "view_dtype_placements",
    "view_dtype_strategy",
]

aten = torch.ops.aten


class UnrepresentableShardWarning(UserWarning):
    """A last-dim shard cannot be reinterpreted locally; DTensor will redistribute it."""


# view.dtype(Tensor(a) self, ScalarType dtype): arg 1 decides the output shape
# and dtype, so it has to be part of the sharding cache key.
VIEW_DTYPE_SCHEMA_INFO = RuntimeSchemaInfo(static_argnum=1)

view_dtype_ops = [aten.view.dtype]


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def partial_commutes_with_view(
    p: Partial, src: torch.dtype, dst: torch.dtype
) -> bool:
    """Whether ``reduce(view(x_i)) == view(reduce(x_i))`` holds for every input."""
    if type(p) is not Partial:  # _MaskPartial & co carry rank-local state
        return False
    if src == dst:  # identity
        return True
    # two's complement reinterpretation between equal widths is a ring isomorphism
    return (
        p.reduce_op == "sum"
        and _is_integer(src)
        and _is_integer(dst)
        and src.itemsize == dst.itemsize
    )


def _last_dim_shards_reinterpretable(
    spec: DTensorSpec,
    placements: Sequence[Placement],
    src_size: int,
    dst_size: int,
    shape: Sequence[int],
) -> tuple[bool, str]:
    """Check the byte ranges of every rank's last-dim shard (see module doc)."""
    last = len(shape) - 1
    mesh_dims = [m for m in mesh_dims_sharding(spec, last) if is_shard_like(placements[m])]
    if not mesh_dims:
        return True, ""
    if any(not isinstance(placements[m], Shard) for m in mesh_dims):
        return False, "the last dim is strided-sharded"
    n_in = shape[last]
    n_out = n_in * src_size // dst_size
    mesh_shape = spec.mesh.shape
    widths_in, widths_out = [], []
    ok = True
    for coord in mesh_coordinates(mesh_shape):
        off_in, len_in = local_range(n_in, mesh_shape, coord, mesh_dims)
        off_out, len_out = local_range(n_out, mesh_shape, coord, mesh_dims)
        widths_in.append(len_in)
        widths_out.append(len_out)
        if off_in * src_size != off_out * dst_size or len_in * src_size != len_out * dst_size:
            ok = False
        # a contiguous [.., 0] local has stride 1 on dim -2, which a wider dtype rejects
        if dst_size > src_size and len_in == 0 and len(shape) > 1:
            ok = False
    why = (
        f"local last-dim widths {widths_in} x {src_size} bytes != output shard widths "
        f"{widths_out} x {dst_size} bytes"
    )
    return ok, why


def view_dtype_placements(
    spec: DTensorSpec, dst: torch.dtype
) -> tuple[tuple[Placement, ...], str]:
    """Placements the input must be in (and the output will be in), plus why they changed."""
    meta = spec.tensor_meta
    if meta is None:
        raise AssertionError("view.dtype sharding needs the input tensor meta")
    src = meta.dtype
    placements: list[Placement] = [
        Replicate()
        if isinstance(p, Partial) and not partial_commutes_with_view(p, src, dst)
        else p
        for p in spec.placements
    ]
    why = ""
    shape = tuple(meta.shape)
    if src.itemsize != dst.itemsize and len(shape) > 0:
        ok, why = _last_dim_shards_reinterpretable(
            spec, placements, src.itemsize, dst.itemsize, shape
        )
        if not ok:
            last = len(shape) - 1
            placements = [
                Replicate() if is_shard_like(p) and p.dim == last else p  # type: ignore
                for p in placements
            ]
    return tuple(placements), why


# view.dtype: reinterpret bytes; Partial -> Replicate, last-dim shards kept only
# when every rank's byte range is the torch.chunk byte range of the output.
def view_dtype_strategy(op_schema: OpSchema) -> StrategyType:
    input_strategy = op_schema.args_schema[0]
    dst = op_schema.args_schema[1]
    if not isinstance(input_strategy, OpStrategy):
        raise AssertionError(f"Expected OpStrategy, got {type(input_strategy)}")
    if not isinstance(dst, torch.dtype):
        raise AssertionError(f"Expected a dtype, got {dst!r}")
    strategies = []
    for arg_strategy in input_strategy.strategies:
        in_spec = arg_strategy.output_spec
        placements, why = view_dtype_placements(in_spec, dst)
        changed_shards = [
            (m, p)
            for m, (p, q) in enumerate(zip(in_spec.placements, placements))
            if is_shard_like(p) and not is_shard_like(q)
        ]
        if changed_shards:
            meta = in_spec.tensor_meta
            warnings.warn(
                UnrepresentableShardWarning(
                    f"aten.view.dtype: {tuple(in_spec.placements)} of a "
                    f"{list(meta.shape)} {meta.dtype} tensor on mesh "
                    f"{tuple(in_spec.mesh.shape)} cannot be viewed as {dst} shard by "
                    f"shard ({why}); redistributing mesh dims "
                    f"{[m for m, _ in changed_shards]} to Replicate()"
                ),
                stacklevel=2,
            )
        target = spec_with(in_spec, placements, in_spec.tensor_meta)
        strategies.append(
            OpSpec(
                output_specs=spec_with(in_spec, placements, None),
                input_specs=(target,),
                redistribute_cost=[generate_redistribute_costs(input_strategy, target)],
            )
        )
    return OpStrategy(strategies)


@_probe.checked
def torch_lacks_view_dtype_fix() -> bool:
    """Whether torch's ``view.dtype`` rule leaves the dtype out of the cache key or keeps a
    ``Partial(sum)`` through a float32 -> int32 view (refusing it, as upstream does, is a fix)."""
    prop = _compat.propagator()
    op = aten.view.dtype
    if not _probe.has_rule(op):
        return True
    info = (getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}).get(op)
            or prop.op_to_schema_info.get(op))
    if info is None or info.static_argnum > 1:
        return True
    partial = _probe.spec((4,), torch.float32, [Partial()])
    placements = _probe.output_placements(op, (partial, torch.int32))
    return placements is not None and _probe.has_partial(placements)


RULES: tuple[Rule, ...] = tuple(
    Rule(
        op=op,
        form="strategy",
        impl=view_dtype_strategy,
        schema_info=VIEW_DTYPE_SCHEMA_INFO,
        needed=torch_lacks_view_dtype_fix,
        reason=(
            "view.dtype: dtype in the cache key; Partial -> Replicate (bits of a "
            "reduction are not the reduction of bits); last-dim shards rescaled "
            "exactly or redistributed"
        ),
    )
    for op in view_dtype_ops
)

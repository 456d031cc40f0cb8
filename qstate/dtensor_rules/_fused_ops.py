"""``qstate::fused_update`` on DTensors: the update is elementwise, so it runs shard by shard.

Algebra: an elementwise update of each ``param`` from its ``grad`` and ``states`` with
replicated scalars commutes with any ``Shard``/``Replicate`` layout that all of
them share: the update of a shard is the shard of the update. ``Partial``
inputs (the sum of the shards is not a shard of the sum) and differing layouts
would need communication; the strategy rejects them instead (:class:`LayoutMismatch`,
raised during sharding propagation, before any tensor is written), so the step
issues zero collectives. ``hyper`` is replicated.

The rule is a sharding strategy, as torch's for ``_fused_adamw_``: one :class:`OpSpec` whose
input specs are the arguments' own (nothing is redistributed; an uneven or empty shard is a shard
like any other), so DTensor calls the op on the local shards. (``register_sharding`` would drop
layouts where a tensor has fewer rows than shards: a ``[2, n]`` parameter on 3 ranks.)

With stochastic rounding, each element's draw follows its place in the full parameter:
``starts[i]`` (:func:`flat_starts`) is an int64 DTensor sharded as ``params[i]``, one
element per shard holding that shard's first flat index, so each shard's op reads its own.
That needs every shard to be one range of the flat parameter (``Shard(0)``/``Replicate``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, StrategyType, \
    TupleStrategy
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import Shard

from qstate._library import fused_update, states_per_param
from qstate._dtensor import dtensor_type
from qstate.dtensor_rules._placements import local_range, mesh_coordinates, mesh_dims_sharding
from qstate.dtensor_rules._registry import Rule

__all__ = ["QSTATE_OP_RULES", "LayoutMismatch", "flat_starts", "fused_update_strategy", "layout_mismatch",
           "update_mismatch"]


class LayoutMismatch(ValueError):
    """``qstate::fused_update`` cannot run these DTensors shard by shard: their shapes, meshes or
    placements differ, or a placement is ``Partial``. Raised before any tensor is written (the
    optimizers then run those parameters' math op by op)."""


def _spec_mismatch(specs: tuple, names: tuple[str, ...]) -> Optional[LayoutMismatch]:
    """Why DTensors of these specs (param first) cannot be updated shard by shard, or ``None``."""
    spec = specs[0]
    for name, other in zip(names[1:], specs[1:]):
        if not _same_layout(spec, other):
            return LayoutMismatch(
                f"{name} must match param (shape {tuple(spec.shape)}, placements {spec.placements} on "
                f"{spec.mesh}), got shape {tuple(other.shape)}, placements {other.placements} on {other.mesh}")
    if any(pl.is_partial() for pl in spec.placements):
        return LayoutMismatch(f"Partial placements {spec.placements} are not shards of the update; redistribute first")
    return None


def _same_layout(spec, other) -> bool:
    """Whether two DTensor specs have one global shape, mesh and placements. Asked every step:
    identity settles most compares (FSDP2 builds a parameter's sharded gradient on the
    parameter's own spec), and the spec's global shape is a plain attribute (the tensor's is a
    sizes call)."""
    if other is spec:
        return True
    mesh, placements = spec.mesh, spec.placements
    return ((other.mesh is mesh or other.mesh == mesh)
            and (other.placements is placements or other.placements == placements)
            and other.shape == spec.shape)


def _names(n: int) -> tuple[str, ...]:
    """The argument names of ``(param, grad, *states)`` for a parameter with ``n`` states."""
    return ("param", "grad", *(f"states[{j}]" for j in range(n)))


def layout_mismatch(param, grad, states) -> Optional[Exception]:
    """Why the strategy rejects the update of ``param`` shard by shard (``None``: it takes it).

    It takes it when ``param``, ``grad`` and every state are DTensors of one shape, mesh and
    placements, none of them ``Partial``.
    """
    DTensor = dtensor_type()
    tensors = (param, grad, *states)
    names = _names(len(states))
    for name, t in zip(names, tensors):
        if not isinstance(t, DTensor):
            return TypeError(f"{name} is a {type(t).__name__}, expected a DTensor")
    return _spec_mismatch(tuple(t._spec for t in tensors), names)


def _flat_range(spec) -> bool:
    """Whether each shard of ``spec`` is one range of the flat (row-major) tensor: every placement
    exactly ``Shard(0)`` (a ``_StridedShard``'s rows interleave with other ranks') or ``Replicate``."""
    return all(pl.is_replicate() or (type(pl) is Shard and pl.dim == 0) for pl in spec.placements)


def update_mismatch(param, grad, states, stochastic_round: bool) -> Optional[Exception]:
    """Why one parameter's update cannot run shard by shard (``None``: it can): :func:`layout_mismatch`,
    and with stochastic rounding a shard that is not one range of the flat parameter
    (:func:`flat_starts`)."""
    error = layout_mismatch(param, grad, states)
    if error is not None or not stochastic_round:
        return error
    return None if _flat_range(param._spec) else _not_flat(param._spec)


#: DTensor parameter -> (its spec, its starts): built once per parameter
_STARTS = WeakIdKeyDictionary()


def flat_starts(param):
    """The ``starts`` argument of ``qstate::fused_update`` for the DTensor ``param``: an int64 DTensor
    with ``param``'s mesh and placements and one element per shard, the flat (row-major) index in the
    full tensor of the shard's first element (every rank computes them all: no collectives). Raises
    :class:`LayoutMismatch` where a shard is not one range of the flat parameter (a placement other
    than ``Shard(0)``/``Replicate``). Built once per parameter."""
    from torch.distributed.tensor import distribute_tensor

    spec = param._spec
    cached = _STARTS.get(param)
    if cached is not None and cached[0] is spec:
        return cached[1]
    if not _flat_range(spec):
        raise _not_flat(spec)
    shape, mesh_shape = tuple(spec.shape), tuple(spec.mesh.shape)
    dims = mesh_dims_sharding(spec, 0)
    shards = math.prod(mesh_shape[m] for m in dims)
    row = math.prod(shape[1:])
    full = [0] * shards
    for coordinate in mesh_coordinates(mesh_shape):  # shard k of ``full`` is element k: the same chunking
        index, _ = local_range(shards, mesh_shape, coordinate, dims)
        full[index] = local_range(shape[0], mesh_shape, coordinate, dims)[0] * row if shape else 0
    starts = distribute_tensor(torch.tensor(full, dtype=torch.int64), spec.mesh, spec.placements,
                               src_data_rank=None)
    _STARTS[param] = (spec, starts)
    return starts


def _not_flat(spec) -> LayoutMismatch:
    return LayoutMismatch(f"placements {spec.placements} do not keep each shard one range of the flat "
                          f"parameter (Shard(0) and Replicate do)")


def _specs(arg) -> tuple:
    """The DTensor specs of a tensor-list argument's strategy."""
    children = arg.children if isinstance(arg, TupleStrategy) else arg
    return tuple(child.strategies[0].output_spec for child in children)


def fused_update_strategy(op_schema: OpSchema) -> StrategyType:
    """``qstate::fused_update(params, grads, states, hyper, variant, sr_keys=None, starts=None)``: every
    tensor keeps its layout. Each ``grads[i]`` and state must share ``params[i]``'s shape, mesh and
    placements, none ``Partial``; ``hyper`` is replicated; ``starts[i]`` has ``params[i]``'s mesh and
    placements, each of them ``Shard(0)`` or ``Replicate`` (else :class:`LayoutMismatch`)."""
    args = op_schema.args_schema
    params, grads, states = (_specs(a) for a in args[:3])
    n = states_per_param(params, grads, states)
    for i, (param, grad) in enumerate(zip(params, grads)):
        error = _spec_mismatch((param, grad, *states[i * n:(i + 1) * n]), _names(n))
        if error is not None:
            raise LayoutMismatch(f"qstate::fused_update on DTensors: params[{i}]: {error}")
    hyper = args[3].strategies[0].output_spec
    if not all(pl.is_replicate() for pl in hyper.placements):
        raise ValueError(f"qstate::fused_update on DTensors: hyper must be replicated, got {hyper.placements}")
    starts = op_schema.kwargs_schema.get("starts", args[6] if len(args) > 6 else None)
    if starts is not None:
        for i, (param, start) in enumerate(zip(params, _specs(starts))):
            if not _flat_range(param):
                raise LayoutMismatch(f"qstate::fused_update on DTensors with starts: params[{i}]: {_not_flat(param)}")
            if start.mesh != param.mesh or start.placements != param.placements:
                raise LayoutMismatch(f"qstate::fused_update on DTensors: starts[{i}] must have params[{i}]'s "
                                     f"placements {param.placements} on {param.mesh}, got {start.placements} on "
                                     f"{start.mesh}")
    inputs = op_schema.args_strategy + op_schema.kwargs_strategy
    own = tuple(s.strategies[0].output_spec for s in inputs)
    costs = [generate_redistribute_costs(s, spec) for s, spec in zip(inputs, own)]
    return OpStrategy([OpSpec(output_specs=None, input_specs=own, redistribute_cost=costs)])


#: qstate's own op (registered by ``import qstate``)
QSTATE_OP_RULES: tuple[Rule, ...] = (
    Rule(
        op=fused_update,
        form="strategy",
        impl=fused_update_strategy,
        reason="qstate's own fused optimizer update: shard by shard, every tensor in its own layout, no collectives",
        schema_info=RuntimeSchemaInfo(needs_pytree=True),
    ),
)

"""Rules for ops that write into, or mix with, ``Partial`` DTensors.

Decisions for the ops stochastic rounding and the optimizers use (W5/W5b/W6/W9);
everything not listed keeps torch's rule, which was checked to be either
correct or a clear error (e.g. ``lerp_``/``addcmul_``/``clamp_`` on a ``Partial``
self raise "in-place operations that require placement changes are not
supported"; ``where``/``lt``/``bitwise_*`` reduce a ``Partial`` input first):

* ``fill_``: fixed.  Every rank writes ``v``, so a ``Partial`` self becomes
  ``Replicate`` (torch kept ``Partial(sum)``: world_size x ``v``).
* ``copy_``: fixed.  A ``Partial`` self becomes ``Replicate`` holding ``src``,
  unless ``src`` is the same ``Partial`` in the same dtype (torch turned a
  ``Replicate`` ``src`` into ``Partial(sum)`` by dividing by the group size:
  wrong for integers, inexact for floats).
* ``add``/``sub`` with an integer operand: fixed.  ``Replicate -> Partial(sum)``
  divides by n (not integral: W5 returned float32), and wrapping integer
  addition is not monotone, so ``max(a_i) + c != max(a_i + c)``; the
  ``Partial`` rules are dropped for non-floating operands, so a ``Partial``
  input is reduced first (and an in-place ``Partial`` self raises).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    StrategyType,
)
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from qstate.dtensor_rules import _probe
from qstate.dtensor_rules._placements import is_shard_like
from qstate.dtensor_rules._registry import Rule


__all__ = [
    "RULES",
    "copy_strategy",
    "fill_strategy",
    "integer_exact_additive_rules",
    "partial_survives_cast",
]

aten = torch.ops.aten


def _replicate(mesh: Any) -> tuple[Placement, ...]:
    return (Replicate(),) * mesh.ndim


def partial_survives_cast(p: Partial, src: torch.dtype, dst: torch.dtype) -> bool:
    """``reduce(cast(x_i)) == cast(reduce(x_i))`` exactly, for every input.

    Only the same dtype, or ``max``/``min`` through a cast that is monotone over every
    ``src`` value: to a floating dtype from a real one (rounding never reorders), or
    between integer dtypes where ``dst`` holds every ``src`` value. A narrowing integer
    cast wraps (``uint8(max(256, 255)) == 0``, ``max(uint8(256), uint8(255)) == 255``)
    and a float-to-integer cast is undefined out of range.
    """
    if type(p) is not Partial:
        return False
    if src == dst:
        return True
    if p.reduce_op not in ("max", "min") or torch.bool in (src, dst) or src.is_complex or dst.is_complex:
        return False
    if dst.is_floating_point:
        return True
    if src.is_floating_point:
        return False
    wide, narrow = torch.iinfo(dst), torch.iinfo(src)
    return wide.min <= narrow.min and narrow.max <= wide.max


# fill_(self, v): every element becomes v on every rank, so Partial(op) ends as
# Replicate (sum of n copies of v is n*v); Shard/Replicate are unchanged.
def fill_strategy(op_schema: OpSchema) -> StrategyType:
    self_strategy = op_schema.args_schema[0]
    value = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else None
    if not isinstance(self_strategy, OpStrategy):
        raise AssertionError(f"Expected OpStrategy, got {type(self_strategy)}")
    mesh = self_strategy.mesh
    strategies = []
    for arg_strategy in self_strategy.strategies:
        self_spec = arg_strategy.output_spec
        out = DTensorSpec(
            mesh,
            tuple(Replicate() if isinstance(p, Partial) else p for p in self_spec.placements),
        )
        input_specs = [self_spec]
        costs = [generate_redistribute_costs(self_strategy, self_spec)]
        if isinstance(value, OpStrategy):  # fill_.Tensor: the 0-dim value is needed whole
            value_spec = DTensorSpec(
                mesh, _replicate(mesh), tensor_meta=value.strategies[0].output_spec.tensor_meta
            )
            input_specs.append(value_spec)
            costs.append(generate_redistribute_costs(value, value_spec))
        strategies.append(
            OpSpec(output_specs=out, input_specs=input_specs, redistribute_cost=costs)
        )
    return OpStrategy(strategies)


def _src_placement_for(
    p: Placement, offset: int, self_shape: Sequence[int], src_shape: Sequence[int]
) -> Placement:
    """The placement ``src`` needs on a mesh dim where ``self`` is sharded as ``p``."""
    d = p.dim - offset  # type: ignore[attr-defined]
    if d < 0 or (src_shape[d] == 1 and self_shape[p.dim] != 1):  # type: ignore[attr-defined]
        return Replicate()  # broadcast dim: every rank needs all of src
    if isinstance(p, Shard):
        return Shard(d)
    return type(p)(d, split_factor=p.split_factor)  # type: ignore[attr-defined,call-arg]


# copy_(self, src): self keeps its layout and src is brought to it; a Partial
# self becomes Replicate holding src, unless src is the same Partial and the
# dtype cast commutes with the reduction (then it stays Partial, no comm).
def copy_strategy(op_schema: OpSchema) -> StrategyType:
    self_strategy, src_strategy = op_schema.args_schema[0], op_schema.args_schema[1]
    if not isinstance(self_strategy, OpStrategy) or not isinstance(src_strategy, OpStrategy):
        raise AssertionError("copy_ expects DTensor self and src")
    mesh = self_strategy.mesh
    self_spec = self_strategy.strategies[0].output_spec
    src_spec = src_strategy.strategies[0].output_spec
    self_meta, src_meta = self_spec.tensor_meta, src_spec.tensor_meta
    if self_meta is None or src_meta is None:
        raise AssertionError("copy_ sharding needs tensor meta")
    offset = len(self_meta.shape) - len(src_meta.shape)
    out: list[Placement] = []
    src_target: list[Placement] = []
    for p, q in zip(self_spec.placements, src_spec.placements):
        if isinstance(p, Partial):
            if q == p and partial_survives_cast(p, src_meta.dtype, self_meta.dtype):
                out.append(p)
                src_target.append(q)
            else:
                out.append(Replicate())
                src_target.append(Replicate())
        elif is_shard_like(p):
            out.append(p)
            src_target.append(_src_placement_for(p, offset, self_meta.shape, src_meta.shape))
        else:
            out.append(p)
            src_target.append(Replicate())
    src_target_spec = DTensorSpec(mesh, tuple(src_target), tensor_meta=src_meta)
    return OpStrategy(
        [
            OpSpec(
                output_specs=DTensorSpec(mesh, tuple(out)),
                input_specs=(self_spec, src_target_spec),
                redistribute_cost=[
                    generate_redistribute_costs(self_strategy, self_spec),
                    generate_redistribute_costs(src_strategy, src_target_spec),
                ],
            )
        ]
    )


# a +/- b over Z/2^k: Replicate -> Partial(sum|avg) divides by n (not integral)
# and wrap-around breaks max(a_i) + c == max(a_i + c), so the Partial rules stay
# only when every tensor operand is floating.
def integer_exact_additive_rules(original: Any) -> Any:
    """Wrap torch's single-dim strategy info for an additive op (see above)."""
    inner = original.func

    def rules(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        strategies = inner(op, args_schema, kwargs_schema)
        metas = [a for a in args_schema if isinstance(a, TensorMeta)]
        if all(m.dtype.is_floating_point or m.dtype.is_complex for m in metas):
            return strategies
        return [s for s in strategies if not any(isinstance(p, Partial) for p in s)]

    return dataclasses.replace(original, func=rules)


fill_ops = [aten.fill_.Scalar, aten.fill_.Tensor]
copy_ops = [aten.copy_.default]
additive_ops = [
    aten.add.Tensor,
    aten.add_.Tensor,
    aten.add.out,
    aten.sub.Tensor,
    aten.sub_.Tensor,
    aten.sub.out,
]

def _lacks_fix(op: torch._ops.OpOverload) -> Callable[[], bool]:
    """The ``needed`` check of ``op``'s rule: does torch's own rule still keep ``Partial`` where
    the result is not a pending reduction (or have no rule at all)?"""

    def check() -> bool:
        partial = _probe.spec((4,), torch.float32, [Partial()])
        replicate = _probe.spec((4,), torch.float32, [Replicate()])
        if op in fill_ops:
            value = _probe.spec((), torch.float32, [Replicate()]) if op is aten.fill_.Tensor else 1.0
            return _probe.has_partial(_probe.output_placements(op, (partial, value)))
        if op in copy_ops:
            return _probe.has_partial(_probe.output_placements(op, (partial, replicate)))
        # integer add/sub: the family's functional form, Partial(sum) + Replicate
        family = aten.add.Tensor if "add" in op._schema.name else aten.sub.Tensor
        ints = (_probe.spec((4,), torch.int32, [Partial()]), _probe.spec((4,), torch.int32, [Replicate()]))
        return _probe.has_partial(_probe.output_placements(family, ints))

    return _probe.checked(check)


RULES: tuple[Rule, ...] = (
    tuple(
        Rule(
            op=op,
            form="strategy",
            impl=fill_strategy,
            needed=_lacks_fix(op),
            reason="fill_ on Partial: result is Replicate (torch kept Partial: n x value)",
        )
        for op in fill_ops
    )
    + tuple(
        Rule(
            op=op,
            form="strategy",
            impl=copy_strategy,
            needed=_lacks_fix(op),
            reason=(
                "copy_ into Partial: result is Replicate unless src is the same "
                "Partial in the same dtype (torch divided a Replicate src by n)"
            ),
        )
        for op in copy_ops
    )
    + tuple(
        Rule(
            op=op,
            form="single_dim",
            impl=integer_exact_additive_rules,
            needed=_lacks_fix(op),
            reason=(
                "add/sub with integer operands: no Partial rules (Replicate -> "
                "Partial(sum) divides by n; wrap-around breaks max/min); Partial is reduced"
            ),
        )
        for op in additive_ops
    )
)

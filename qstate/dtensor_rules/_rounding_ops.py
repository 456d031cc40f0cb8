"""``qstate::stochastic_round_bf16`` and ``qstate::copy_with_draws_`` on DTensors: elementwise, so they
run shard by shard.

The op reads each element of ``x`` and the same element of ``draws`` only, so
it commutes with any ``Shard``/``Replicate`` layout that both share: the
rounding of a shard is the shard of the rounding. Its kernel reinterprets bits
(``view(dtype)``), which does not commute with a reduction, so a ``Partial``
``x`` is reduced first (``Replicate``). ``draws`` is brought to ``x``'s layout;
the output has it.

``copy_with_draws_(self, src, draws)`` writes each element of ``self`` from the
same element of ``src`` and ``draws``: in place, so ``self`` keeps its layout
(``Shard``/``Replicate``; a ``Partial`` ``self`` is rejected: its shards are
not its elements), and ``src`` and ``draws`` are brought to it.
"""

from __future__ import annotations

from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, StrategyType
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import Partial, Replicate

from qstate._library import copy_with_draws_, stochastic_round_bf16
from qstate.dtensor_rules._placements import spec_with
from qstate.dtensor_rules._registry import Rule

__all__ = ["QSTATE_OP_RULES", "copy_with_draws_strategy", "stochastic_round_strategy"]


# stochastic_round_bf16(x, draws): elementwise, not linear; Partial x -> Replicate,
# Shard/Replicate stay, draws follow x.
def stochastic_round_strategy(op_schema: OpSchema) -> StrategyType:
    x_strategy, draws_strategy = op_schema.args_schema[0], op_schema.args_schema[1]
    if not isinstance(x_strategy, OpStrategy) or not isinstance(draws_strategy, OpStrategy):
        raise AssertionError("qstate::stochastic_round_bf16 expects DTensor x and draws")
    draws_meta = draws_strategy.strategies[0].output_spec.tensor_meta
    strategies = []
    for x_op in x_strategy.strategies:
        x_spec = x_op.output_spec
        if draws_meta is not None and x_spec.tensor_meta is not None and (
            tuple(draws_meta.shape) != tuple(x_spec.tensor_meta.shape)
        ):
            raise ValueError(f"qstate::stochastic_round_bf16: draws of shape {tuple(draws_meta.shape)} "
                             f"for x of shape {tuple(x_spec.tensor_meta.shape)}")
        placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x_spec.placements)
        x_target = spec_with(x_spec, placements, x_spec.tensor_meta)
        draws_target = spec_with(x_spec, placements, draws_meta)
        strategies.append(
            OpSpec(
                output_specs=spec_with(x_spec, placements, None),
                input_specs=(x_target, draws_target),
                redistribute_cost=[
                    generate_redistribute_costs(x_strategy, x_target),
                    generate_redistribute_costs(draws_strategy, draws_target),
                ],
            )
        )
    return OpStrategy(strategies)


# copy_with_draws_(self, src, draws): elementwise, in place; self keeps its placements (not Partial),
# src and draws follow self.
def copy_with_draws_strategy(op_schema: OpSchema) -> StrategyType:
    self_strategy, src_strategy, draws_strategy = op_schema.args_schema[:3]
    if not all(isinstance(s, OpStrategy) for s in (self_strategy, src_strategy, draws_strategy)):
        raise AssertionError("qstate::copy_with_draws_ expects DTensor self, src and draws")
    src_meta = src_strategy.strategies[0].output_spec.tensor_meta
    draws_meta = draws_strategy.strategies[0].output_spec.tensor_meta
    strategies = []
    for self_op in self_strategy.strategies:
        self_spec = self_op.output_spec
        if any(isinstance(p, Partial) for p in self_spec.placements):
            raise ValueError(f"qstate::copy_with_draws_: self's placements {self_spec.placements} hold partial "
                             f"values, not elements; redistribute it first")
        for name, meta in (("src", src_meta), ("draws", draws_meta)):
            if meta is not None and self_spec.tensor_meta is not None and (
                tuple(meta.shape) != tuple(self_spec.tensor_meta.shape)
            ):
                raise ValueError(f"qstate::copy_with_draws_: {name} of shape {tuple(meta.shape)} for self of "
                                 f"shape {tuple(self_spec.tensor_meta.shape)}")
        src_target = spec_with(self_spec, self_spec.placements, src_meta)
        draws_target = spec_with(self_spec, self_spec.placements, draws_meta)
        strategies.append(
            OpSpec(
                output_specs=self_spec,
                input_specs=(self_spec, src_target, draws_target),
                redistribute_cost=[
                    generate_redistribute_costs(self_strategy, self_spec),
                    generate_redistribute_costs(src_strategy, src_target),
                    generate_redistribute_costs(draws_strategy, draws_target),
                ],
            )
        )
    return OpStrategy(strategies)


#: qstate's own ops (registered by ``import qstate``)
QSTATE_OP_RULES: tuple[Rule, ...] = (
    Rule(
        op=stochastic_round_bf16,
        form="strategy",
        impl=stochastic_round_strategy,
        reason="qstate's stochastic_round_bf16: elementwise, shard by shard (Partial x reduced first); "
               "draws follow x",
    ),
    Rule(
        op=copy_with_draws_,
        form="strategy",
        impl=copy_with_draws_strategy,
        reason="qstate's copy_with_draws_: elementwise and in place, shard by shard; src and draws follow self",
    ),
)

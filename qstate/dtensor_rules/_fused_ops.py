"""``qstate::fused_update`` on DTensors: the update is elementwise, so it runs shard by shard.

Algebra: an elementwise update of ``param`` from ``grad`` and ``states`` with
replicated scalars commutes with any ``Shard``/``Replicate`` layout that all of
them share: the update of a shard is the shard of the update. ``Partial``
inputs (the sum of the shards is not a shard of the sum) and differing layouts
would need communication; the rule rejects them instead, so the step issues
zero collectives. ``hyper`` is a plain (replicated) tensor.
"""

from __future__ import annotations

from qstate._library import fused_update
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "fused_update_handler"]


def fused_update_handler(op_call, args: tuple, kwargs: dict) -> None:
    from torch.distributed.tensor import DTensor, Partial

    param, grad, states, hyper, kind = args
    named = [("param", param), ("grad", grad)] + [(f"states[{i}]", s) for i, s in enumerate(states)]
    for name, t in named:
        if not isinstance(t, DTensor):
            raise TypeError(f"qstate::fused_update on DTensors: {name} is a {type(t).__name__}, expected a DTensor")
        if t.device_mesh != param.device_mesh or t.placements != param.placements or t.shape != param.shape:
            raise ValueError(
                f"qstate::fused_update on DTensors: {name} must match param (shape {tuple(param.shape)}, "
                f"placements {param.placements} on {param.device_mesh}), got shape {tuple(t.shape)}, "
                f"placements {t.placements} on {t.device_mesh}"
            )
    if any(isinstance(pl, Partial) for pl in param.placements):
        raise ValueError(f"qstate::fused_update on DTensors: Partial placements {param.placements} are not "
                         "shards of the update; redistribute first")
    op_call(param._local_tensor, grad._local_tensor, [s._local_tensor for s in states], hyper, kind, **kwargs)


RULES: tuple[Rule, ...] = (
    Rule(
        op=fused_update,
        kind="handler",
        impl=fused_update_handler,
        reason="qstate's own fused optimizer update: shard by shard, same layouts only, no collectives",
    ),
)

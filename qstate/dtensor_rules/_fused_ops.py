"""``qstate::fused_update`` on DTensors: the update is elementwise, so it runs shard by shard.

Algebra: an elementwise update of ``param`` from ``grad`` and ``states`` with
replicated scalars commutes with any ``Shard``/``Replicate`` layout that all of
them share: the update of a shard is the shard of the update. ``Partial``
inputs (the sum of the shards is not a shard of the sum) and differing layouts
would need communication; the rule rejects them instead, so the step issues
zero collectives. ``hyper`` is a plain (replicated) tensor.
"""

from __future__ import annotations

from typing import Optional

from qstate._library import fused_update
from qstate.distributed import _dtensor_type
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "fused_update_handler", "layout_mismatch"]


def layout_mismatch(param, grad, states) -> Optional[Exception]:
    """Why this rule cannot run the update of ``param`` shard by shard (``None``: it can).

    It can when ``param``, ``grad`` and every state are DTensors of one shape, mesh and
    placements, none of them ``Partial``.
    """
    DTensor = _dtensor_type()
    # checked every step: names are built only for the error, and identity settles most compares
    mesh, placements, shape = getattr(param, "device_mesh", None), getattr(param, "placements", None), param.shape
    for i, t in enumerate((param, grad, *states)):
        if not isinstance(t, DTensor):
            return TypeError(f"{_name(i)} is a {type(t).__name__}, expected a DTensor")
        if ((t.device_mesh is not mesh and t.device_mesh != mesh)
                or (t.placements is not placements and t.placements != placements) or t.shape != shape):
            return ValueError(
                f"{_name(i)} must match param (shape {tuple(shape)}, placements {placements} on "
                f"{mesh}), got shape {tuple(t.shape)}, placements {t.placements} on {t.device_mesh}"
            )
    if any(pl.is_partial() for pl in param.placements):
        return ValueError(f"Partial placements {param.placements} are not shards of the update; redistribute first")
    return None


def _name(i: int) -> str:
    """The argument name of tensor ``i`` of ``(param, grad, *states)``."""
    return "param" if i == 0 else "grad" if i == 1 else f"states[{i - 2}]"


def fused_update_handler(op_call, args: tuple, kwargs: dict) -> None:
    param, grad, states, hyper, kind = args
    error = layout_mismatch(param, grad, states)
    if error is not None:
        raise type(error)(f"qstate::fused_update on DTensors: {error}")
    op_call(param._local_tensor, grad._local_tensor, [s._local_tensor for s in states], hyper, kind, **kwargs)


RULES: tuple[Rule, ...] = (
    Rule(
        op=fused_update,
        kind="handler",
        impl=fused_update_handler,
        reason="qstate's own fused optimizer update: shard by shard, same layouts only, no collectives",
    ),
)

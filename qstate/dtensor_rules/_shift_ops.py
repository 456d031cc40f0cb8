"""``>>`` and ``<<`` on DTensors (``aten.__rshift__`` / ``aten.__lshift__``).

DTensor (torch 2.13) takes an op whose schema name ends in ``_`` for an
in-place op and returns its first argument: ``__rshift__`` and ``__lshift__``
(the ``x >> k`` / ``x << k`` operators, out of place despite their names)
then return ``x`` unchanged, silently. The handlers run the same shift as
``aten.bitwise_right_shift`` / ``bitwise_left_shift``, whose rules DTensor
gets right (pointwise: placements stay, no communication). The in-place
``>>=`` / ``<<=`` (``__irshift__`` / ``__ilshift__``) are correct as they are.

Who needs it: stochastic rounding's draws (``qstate._random.position_draws``,
a hash of each element's index with shifts) on DTensor parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Replicate

from qstate.dtensor_rules import _compat, _probe
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "shift_handler"]

aten = torch.ops.aten

#: each shift operator and the op it means
SHIFT_OPS: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
    aten.__rshift__.Scalar: aten.bitwise_right_shift.Tensor_Scalar,
    aten.__rshift__.Tensor: aten.bitwise_right_shift.Tensor,
    aten.__lshift__.Scalar: aten.bitwise_left_shift.Tensor_Scalar,
    aten.__lshift__.Tensor: aten.bitwise_left_shift.Tensor,
}


def shift_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    return SHIFT_OPS[op](*args, **kwargs)


def _taken_for_in_place(op: torch._ops.OpOverload) -> Callable[[], bool]:
    """The ``needed`` check: does DTensor still take ``op`` for in place (``OpSchema.is_inplace_op``)
    with no handler of its own for it?"""
    def check() -> bool:
        x = _probe.spec((4,), torch.int32, [Replicate()])
        return op not in _compat.dispatcher()._custom_op_handlers and OpSchema(op, (x, 1), {}).is_inplace_op()

    return _probe.checked(check)


RULES: tuple[Rule, ...] = tuple(
    Rule(op=op, form="handler", impl=shift_handler, needed=_taken_for_in_place(op),
         reason=f"torch returns the input unchanged (a name ending in '_' taken for in place): run {target}")
    for op, target in SHIFT_OPS.items()
)

"""``_foreach_addcdiv``/``_foreach_addcmul`` with a tensor of scalars (``.Tensor``), in place and out of place.

The ``.Tensor`` overloads take one scalar per list element in a host tensor, which their kernel
reads as a list of scalars (ATen's ``convert_tensor_to_scalar_list``) before running the
``.ScalarList`` overload. On DTensors torch fails to propagate them (the fake run rejects the
fake host tensor, and the foreach expansion broadcasts ``scalars`` against each element). The
handlers run the ``.ScalarList`` overload with the same scalars, after torch's own checks of the
arguments (a plain ``scalars`` of more than one element needs ``implicit_replication()``, as any
plain tensor mixed with DTensors); its rule is the elementwise one of the ``.Tensor`` form.
"""

from __future__ import annotations

from typing import Any

import torch

from torch.distributed.tensor.placement_types import Replicate

from qstate.dtensor_rules import _compat, _probe
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "foreach_scalars_handler"]

aten = torch.ops.aten

#: each ``.Tensor`` overload and the in-place ``.ScalarList`` overload its kernel runs (on clones of
#: ``self`` for the out-of-place forms, whose ``.ScalarList`` overloads DTensor has no rule for)
SCALAR_LIST_OPS = {
    aten._foreach_addcdiv_.Tensor: aten._foreach_addcdiv_.ScalarList,
    aten._foreach_addcmul_.Tensor: aten._foreach_addcmul_.ScalarList,
    aten._foreach_addcdiv.Tensor: aten._foreach_addcdiv_.ScalarList,
    aten._foreach_addcmul.Tensor: aten._foreach_addcmul_.ScalarList,
}


def foreach_scalars_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    _compat.dispatcher().unwrap_to_op_info(op, args, kwargs)  # torch's checks of mixed Tensor/DTensor
    bound = list(args) + [kwargs[a.name] for a in op._schema.arguments[len(args):] if a.name in kwargs]
    # the one argument of type Tensor (the lists are Tensor[])
    index = next(i for i, a in enumerate(op._schema.arguments) if str(a.type) == "Tensor")
    scalars = bound[index]
    if hasattr(scalars, "full_tensor"):
        scalars = scalars.full_tensor()
    bound[index] = scalars.tolist()
    if op._schema.returns:  # out of place
        bound[0] = [t.clone() for t in bound[0]]
        SCALAR_LIST_OPS[op](*bound)
        return bound[0]
    return SCALAR_LIST_OPS[op](*bound)


@_probe.checked
def _fails_to_propagate() -> bool:
    """Whether torch's propagation of ``_foreach_addcdiv_.Tensor`` on two replicated elements raises."""
    element = _probe.spec((4,), torch.float32, [Replicate()])
    scalars = _probe.spec((2,), torch.float32, [Replicate()])
    lists = ([element, element],) * 3
    return isinstance(_probe.propagate(aten._foreach_addcdiv_.Tensor, (*lists, scalars)), Exception)


RULES: tuple[Rule, ...] = tuple(
    Rule(op=op, form="handler", impl=foreach_scalars_handler, needed=_fails_to_propagate,
         reason=f"tensor of scalars: run {target} with its scalars (torch failed to propagate)")
    for op, target in SCALAR_LIST_OPS.items()
)

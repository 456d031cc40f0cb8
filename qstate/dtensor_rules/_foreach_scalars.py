"""``_foreach_addcdiv``/``_foreach_addcmul`` with a tensor of scalars (``.Tensor``), in place and out of place.

The ``.Tensor`` overloads take one scalar per list element in a 1-D contiguous CPU tensor, which
their kernels read on the host into a scalar list (ATen's ``convert_tensor_to_scalar_list``) before
running the ``.ScalarList`` overload. On DTensors torch fails to propagate them (the fake run cannot
read a fake ``scalars``, and the foreach expansion broadcasts ``scalars`` against each element). The
handlers do what the kernels do: check ``scalars`` with their checks and messages, read it on the
host (a DTensor ``scalars`` is gathered first) and run the matching ``.ScalarList`` overload, whose
rule is the pointwise foreach one. Where torch has no rule for an out-of-place ``.ScalarList``
overload (torch 2.13), the in-place one runs on clones of ``self``. A plain ``scalars`` is not a
DTensor operand: it needs no ``implicit_replication()``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Replicate

from qstate.dtensor_rules import _probe
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "foreach_scalars_handler"]

aten = torch.ops.aten

#: each ``.Tensor`` overload and the ``.ScalarList`` overload its kernel runs
SCALAR_LIST_OPS = {
    aten._foreach_addcdiv_.Tensor: aten._foreach_addcdiv_.ScalarList,
    aten._foreach_addcmul_.Tensor: aten._foreach_addcmul_.ScalarList,
    aten._foreach_addcdiv.Tensor: aten._foreach_addcdiv.ScalarList,
    aten._foreach_addcmul.Tensor: aten._foreach_addcmul.ScalarList,
}
#: each out-of-place ``.ScalarList`` overload and its in-place form
IN_PLACE = {
    aten._foreach_addcdiv.ScalarList: aten._foreach_addcdiv_.ScalarList,
    aten._foreach_addcmul.ScalarList: aten._foreach_addcmul_.ScalarList,
}


def _scalar_list(scalars: Any, num_tensors: int) -> list[Any]:
    """``scalars`` read on the host, after the kernels' checks (``convert_tensor_to_scalar_list``)."""
    if hasattr(scalars, "full_tensor"):
        scalars = scalars.full_tensor()
    if scalars.device.type != "cpu":
        raise RuntimeError(f"Expected scalars to be on CPU, got {scalars.device} instead.")
    if not scalars.is_contiguous():
        raise RuntimeError("Expected scalars to be contiguous.")
    if scalars.dim() != 1:
        raise RuntimeError(f"Expected packed scalar Tensor to be of dimension 1. Got {scalars.dim()} instead.")
    if scalars.size(0) != num_tensors:
        raise RuntimeError(f"Expected length of scalars to match input of length {num_tensors} but got "
                           f"{scalars.size(0)} instead.")
    return scalars.tolist()


@functools.cache
def _has_rule(op: torch._ops.OpOverload) -> bool:
    """Whether torch propagates ``op`` on lists of two replicated elements."""
    element = _probe.spec((4,), torch.float32, [Replicate()])
    lists = ([element, element],) * 3
    return not isinstance(_probe.propagate(op, (*lists, [0.5, 0.5])), Exception)


def foreach_scalars_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    names = [a.name for a in op._schema.arguments]
    self, tensor1, tensor2, scalars = [*args, *(kwargs[n] for n in names[len(args):])]
    target, scalar_list = SCALAR_LIST_OPS[op], _scalar_list(scalars, len(self))
    if target not in IN_PLACE or _has_rule(target):
        return target(self, tensor1, tensor2, scalar_list)
    out = [t.clone() for t in self]  # torch has no rule for the out-of-place overload
    IN_PLACE[target](out, tensor1, tensor2, scalar_list)
    return out


@_probe.checked
def _fails_to_propagate() -> bool:
    """Whether torch's propagation of ``_foreach_addcdiv_.Tensor`` on two replicated elements raises
    (a torch that handles the op before propagation has a handler for it)."""
    from qstate.dtensor_rules import _compat

    if aten._foreach_addcdiv_.Tensor in _compat.dispatcher()._custom_op_handlers:
        return False
    element = _probe.spec((4,), torch.float32, [Replicate()])
    scalars = _probe.spec((2,), torch.float32, [Replicate()])
    lists = ([element, element],) * 3
    return isinstance(_probe.propagate(aten._foreach_addcdiv_.Tensor, (*lists, scalars)), Exception)


RULES: tuple[Rule, ...] = tuple(
    Rule(op=op, form="handler", impl=foreach_scalars_handler, needed=_fails_to_propagate,
         reason=f"tensor of scalars: read on the host and run {target} (torch failed to propagate)")
    for op, target in SCALAR_LIST_OPS.items()
)

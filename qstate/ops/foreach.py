"""torch's ``_foreach_*`` ops over lists holding states: the per-tensor op, tensor by tensor.

``torch.optim``'s foreach implementations (and libraries built like them) call one
``_foreach_<op>`` over a list of states. A list holding a :class:`~qstate.QuantizedState`
runs ``<op>`` on each position in turn, with the position's element of every list argument
(``Tensor[]``, ``Scalar[]``, and the one-value-per-tensor ``scalars`` tensor of
``addcmul``/``addcdiv``) and the other arguments as they are (where torch has no in-place
per-tensor op, ``maximum_``, the out-of-place result is copied in); each position then follows the
per-tensor op's rules (:mod:`qstate.ops.math`: in place on a state, the result requantized into
its layout; out of place, plain values). A per-tensor op a state does not support raises its own
error at the first state, before later positions are written; earlier positions are written.
"""

from __future__ import annotations

from typing import Any

import torch

from .._op_table import register
from ._util import aten

#: the ``_foreach_`` families routed tensor by tensor (in-place ``<op>_`` and out-of-place ``<op>``)
FAMILIES = ("add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "maximum", "minimum", "clamp_min",
            "clamp_max", "sqrt", "neg", "abs", "sign", "reciprocal", "pow", "copy", "zero")
#: per-tensor ops whose scalar is keyword-only where the foreach op's is positional
_KEYWORD_SCALAR = {"addcmul": "value", "addcdiv": "value"}


def _foreach_ops() -> list[torch._ops.OpOverload]:
    ops = []
    for family in FAMILIES:
        for name in (f"_foreach_{family}_", f"_foreach_{family}"):
            packet = getattr(aten, name, None)
            if packet is None:
                continue
            ops += [getattr(packet, overload) for overload in packet.overloads() if overload != "out"]
    return ops


def _element(arg: torch.Argument, value: Any, i: int) -> Any:
    """The argument of the per-tensor op at position ``i``."""
    if isinstance(arg.type, torch.ListType):  # Tensor[], Scalar[]
        return value[i]
    if arg.name == "scalars" and isinstance(value, torch.Tensor):  # one value per tensor (addc*.Tensor)
        return value[i].item()
    return value


@register(*_foreach_ops())
def _foreach(func, args, kwargs):
    family = func._schema.name.removeprefix("aten::_foreach_")
    inplace = family.endswith("_")
    per_tensor = getattr(aten, family, None)
    if per_tensor is None:  # no in-place per-tensor op (maximum_, minimum_): the result, copied in
        out_of_place = getattr(aten, family.rstrip("_"))

        def per_tensor(target, *rest, **named):
            return target.copy_(out_of_place(target, *rest, **named))
    schema_args = func._schema.arguments
    bound = dict(zip((a.name for a in schema_args), args)) | kwargs
    n = len(bound[schema_args[0].name])
    keyword = _KEYWORD_SCALAR.get(family.rstrip("_"))
    results = []
    for i in range(n):
        positional, named = [], {}
        for arg in schema_args:
            if arg.name not in bound:
                continue
            value = _element(arg, bound[arg.name], i)
            if arg.kwarg_only:
                named[arg.name] = value
            elif keyword is not None and arg.name in ("value", "scalars"):
                named[keyword] = value
            else:
                positional.append(value)
        results.append(per_tensor(*positional, **named))
    return None if inplace else results

"""Ops that read a state as numbers.

Out-of-place math returns **plain** tensors computed on the dequantized values
(appearance dtype). In-place math on a state computes on its dequantized values
and requantizes the result into the same layout; in-place math on a plain
tensor with a state argument reads the state. Beyond the ops listed here, every
op torch tags ``pointwise`` or ``reduction`` follows the same rules (an ``out=``
state raises: it would be a conversion).
"""

from __future__ import annotations

import torch

from .._state import QuantizedState
from .._op_table import register, register_by_name, register_by_tag
from ._util import aten, dequantize_args
from .copy import copy_into_state

#: out-of-place ops an optimizer (or a test) reads a state with -> plain result
READ_OPS = [
    aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.rsub.Scalar, aten.neg.default, aten.abs.default, aten.sign.default,
    aten.sqrt.default, aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.maximum.default, aten.minimum.default,
    aten.lerp.Scalar, aten.lerp.Tensor, aten.addcmul.default, aten.addcdiv.default, aten.clamp.default,
    aten.where.self, aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.amax.default, aten.max.default, aten.min.default, aten.linalg_vector_norm.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.isfinite.default, aten.isnan.default,
    aten.clamp_min.default, aten.clamp_max.default, aten.reciprocal.default, aten.gt.Tensor, aten.gt.Scalar,
    aten.ge.Tensor, aten.ge.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar,
]
#: reads that index, sort, scan or select values -> plain result
SELECT_OPS = [
    aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.masked_select.default,
    aten.nonzero.default, aten.sort.default, aten.sort.stable, aten.topk.default, aten.kthvalue.default,
    aten.median.default, aten.median.dim, aten.cumsum.default, aten.cumprod.default, aten.flip.default,
    aten.roll.default, aten.tril.default, aten.triu.default, aten.trace.default, aten.histc.default,
    aten._softmax.default, aten._log_softmax.default, aten._cdist_forward.default,
]
#: matrix products reading a state -> plain result
MATMUL_OPS = [aten.mm.default, aten.mv.default, aten.dot.default, aten.bmm.default, aten.addmm.default,
              aten.addmv.default, aten.baddbmm.default, aten.addbmm.default]

#: in-place ops; on a state they requantize into its layout
INPLACE_OPS = [
    aten.mul_.Tensor, aten.mul_.Scalar, aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar,
    aten.div_.Tensor, aten.div_.Scalar, aten.lerp_.Scalar, aten.lerp_.Tensor, aten.addcmul_.default,
    aten.addcdiv_.default, aten.sqrt_.default, aten.clamp_.default, aten.fill_.Scalar, aten.maximum.out,
    aten.neg_.default, aten.abs_.default, aten.sign_.default, aten.reciprocal_.default, aten.clamp_min_.default,
    aten.clamp_max_.default, aten.pow_.Scalar, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor,
    aten.index_put_.default, aten.masked_scatter_.default, aten.scatter_.src, aten.scatter_.value,
    aten.scatter_add_.default, aten.index_fill_.int_Scalar, aten.index_copy_.default, aten.index_add_.default,
]


#: read ops named, for ops defined only once another module loads: inductor's fused multiply-add, which
#: ``torch.compile`` emits for ``addcmul_``/``add_`` with a value (``fma(a, b, c) = a * b + c``)
NAMED_READ_OPS = ["prims::fma"]


# optimizers reading moments (exp_avg.mul(beta), exp_avg_sq.sqrt(), ...) and tests
@register_by_name(*NAMED_READ_OPS)
@register(*READ_OPS, *SELECT_OPS, *MATMUL_OPS)
def _read(func, args, kwargs):
    return func(*dequantize_args(args), **dequantize_args(kwargs))


# torch.optim-style in-place updates on states (exp_avg.lerp_(grad, 1 - beta1), ...)
@register(*INPLACE_OPS)
def _inplace(func, args, kwargs):
    target = args[0] if args else kwargs["out"]
    if not isinstance(target, QuantizedState):
        return func(*dequantize_args(args), **dequantize_args(kwargs))
    values = target.dequantize(torch.float32)
    rest = dequantize_args((args[1:], kwargs))
    if args:
        result = func(values, *rest[0], **rest[1])
    else:
        result = func(*rest[0], **{**rest[1], "out": values})
    copy_into_state(target, result)
    return target


# the rest of torch's elementwise math and reductions (exp, tanh, std, var, max(dim), argmax, ...)
@register_by_tag(torch.Tag.pointwise, torch.Tag.reduction)
def _family(func, args, kwargs):
    if torch.Tag.inplace in func.tags:
        return _inplace(func, args, kwargs)
    for out in _outs(func, args, kwargs):
        if isinstance(out, QuantizedState):
            raise NotImplementedError(f"{func}: out= takes plain tensors, got a state [{out.describe()}]; compute "
                                      "into a plain tensor and copy_ it into the state (one requantize)")
    return _read(func, args, kwargs)


def _outs(func, args, kwargs) -> list:
    """The ``out=`` arguments of ``func``'s call."""
    return [kwargs.get(a.name) for a in func._schema.arguments if a.kwarg_only and a.is_out]

"""c10d functional collectives on states (DTensor ``full_tensor``/``redistribute``).

Collectives run on the inner tensors and are **waited inside the handler**, so
``codes``/``scale`` are never AsyncCollectiveTensors; funcol wraps the *outer*
state, and ``wait_tensor`` on it is the identity.
"""

from __future__ import annotations

import torch

from .._state import QuantizedState
from .._op_table import register
from ._util import check_same_kind

import torch.distributed._functional_collectives  # noqa: F401  (defines _wrap_tensor_autograd)

c10d = torch.ops._c10d_functional
# torch >= 2.10 wraps funcol results with this custom op
_WRAP_OPS = [c10d._wrap_tensor_autograd.default] if hasattr(c10d, "_wrap_tensor_autograd") else []


def _gather(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_gather_into_tensor(t.contiguous(), group_size, group_name))


# DTensor Shard(0) -> Replicate (full_tensor, redistribute): rows of every rank, in rank order
@register(c10d.all_gather_into_tensor.default)
def _all_gather(func, args, kwargs):
    q, group_size, group_name = args
    codes = _gather(q.codes, group_size, group_name)
    scale = _gather(q.scale, group_size, group_name)
    if q.dim() >= 2:
        shape = (q.shape[0] * group_size, *q.shape[1:])
        return q.with_parts(codes, scale, shape=shape)
    if q.rows != 1 or q.numel() != q.row_len:
        raise NotImplementedError(
            f"all_gather_into_tensor: a 1-D state must be one whole row to gather, got {q.rows} rows of "
            f"{q.row_len} [{q.describe()}]"
        )
    return q.with_parts(codes, scale, shape=(q.numel() * group_size,))


# funcol.wait_tensor / _maybe_wrap_tensor on the outer state: the inner collectives were
# already waited, so the state is returned as is (never an AsyncCollectiveTensor inside)
@register(c10d.wait_tensor.default, *_WRAP_OPS)
def _already_waited(func, args, kwargs):
    return args[0]


_PARTS = ("codes", "scale")


def _check_same_layout(out: QuantizedState, sources: list, op: str) -> None:
    for src in sources:
        if not isinstance(src, QuantizedState):
            raise TypeError(f"{op}: expected a QuantizedState like [{out.describe()}], got {type(src).__name__}")
        check_same_kind(op, out, src)
        if src.codes.shape != out.codes.shape or src.scale.shape != out.scale.shape:
            raise ValueError(f"{op}: expected a state stored like [{out.describe()}], got [{src.describe()}]")


# distribute_tensor(full_state, mesh, [Shard(0)]) (set_optimizer_state_dict with full state dicts):
# the root's equal-size (padded) row chunks go one per rank, part by part, then the work is waited
@register(torch.ops.c10d.scatter_.default)
def _scatter(func, args, kwargs):
    outputs, inputs, pg, root, *rest = args
    for out in outputs:
        for chunks in inputs:
            _check_same_layout(out, chunks, "scatter")
    work = None
    for part in _PARTS:
        _, work = func([getattr(o, part) for o in outputs],
                       [[getattr(c, part) for c in chunks] for chunks in inputs], pg, root, *rest, **kwargs)
        work.wait()
    return outputs, work


# distribute_tensor(full_state, mesh, [Replicate()]): every rank receives the root's parts
@register(torch.ops.c10d.broadcast_.default)
def _broadcast(func, args, kwargs):
    tensors, pg, root, root_tensor, *rest = args
    work = None
    for part in _PARTS:
        _, work = func([getattr(t, part) for t in tensors], pg, root, root_tensor, *rest, **kwargs)
        work.wait()
    return tensors, work

"""``QuantizedStateView``: a view of a :class:`~qstate.QuantizedState` that is not a state itself.

A state is stored as rows of blocks (:mod:`qstate._state`), so a view along dim 0 at row boundaries
is a state. Every other view (``t``, ``transpose``, ``permute``, ``select``, slicing along dim >= 1
or with a step, ``diagonal``, ``expand``, ``unfold``, ``as_strided``) is a ``QuantizedStateView``:
the state it views (``base``) and torch's size, stride and storage offset over ``base``'s elements
in row-major order.

Storage rules:

* It holds no codes of its own: it aliases ``base``, and a view of it is a view of ``base``.
* An op that reads it gets its values as a plain tensor of the same strides, decoded from the rows
  of ``base`` it lies in (and only those): reads return plain tensors, as they do on a state.
* An in-place op on it decodes those rows, applies the op to the view's elements, and encodes back
  into ``base`` only the blocks that hold one, in ``base``'s format, block size and rounding: one
  requantize per write, as on the state itself; no other block changes.
* ``clone`` (``contiguous``, ``deepcopy``) copies the rows it lies in and views the copy: the same
  values, exactly; ``.to(device)`` moves that copy. ``.to(dtype)`` of another dtype reads plain values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_map, tree_flatten

from ._state import VIEW_TYPES, QuantizedState

__all__ = ["QuantizedStateView", "view_of_state"]


class QuantizedStateView(Tensor):
    """A strided view of a :class:`QuantizedState` (``base``): reads decode, in-place ops write back."""

    base: QuantizedState

    @staticmethod
    def __new__(cls, base: QuantizedState, size: Sequence[int], stride: Sequence[int],
                storage_offset: int) -> "QuantizedStateView":
        return Tensor._make_wrapper_subclass(cls, tuple(size), strides=tuple(stride), storage_offset=storage_offset,
                                             dtype=base.dtype, device=base.device)

    def __init__(self, base: QuantizedState, size: Sequence[int], stride: Sequence[int], storage_offset: int) -> None:
        self.base = base

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The values as a plain contiguous tensor of ``dtype`` (default: the appearance dtype)."""
        return _Window.of(self).values.contiguous().to(dtype or self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"QuantizedStateView(shape={tuple(self.shape)}, stride={self.stride()}, "
                f"storage_offset={self.storage_offset()}, base={self.base!r})")

    def __deepcopy__(self, memo: dict) -> "QuantizedStateView":
        return self.clone()

    def __reduce_ex__(self, protocol: int):
        raise TypeError(f"a QuantizedStateView is not saved (shape {tuple(self.shape)}, stride {self.stride()} of "
                        f"[{self.base.describe()}]): save the state it views (view.base) or its values "
                        "(qstate.dequantize(view))")

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return ["base"], (tuple(self.shape), self.stride(), self.storage_offset())

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: tuple, outer_size, outer_stride) -> "QuantizedStateView":
        size, stride, offset = ctx
        return cls(inner["base"], size, stride, offset)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.inplace_view in func.tags:  # t_, transpose_, as_strided_: the wrapper's own metadata
            raise NotImplementedError(f"{func} on a QuantizedStateView: use its out-of-place form (a new view), "
                                      f"got shape {tuple(args[0].shape)} of [{args[0].base.describe()}]")
        if func.is_view:
            view = next(x for x in tree_flatten((args, kwargs))[0] if isinstance(x, QuantizedStateView))
            return view_of_state(view, func, args, kwargs)
        if func is torch.ops.aten.clone.default:
            return _Window.of(args[0]).copy()
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype", args[0].dtype) == args[0].dtype:
            return _Window.of(args[0]).copy(kwargs.get("device"))  # a move: the view over moved rows
        written = {id(x) for x in _written_args(func, args, kwargs) if isinstance(x, QuantizedStateView)}
        windows: dict[int, _Window] = {}

        def plain(x: Any) -> Any:
            if not isinstance(x, QuantizedStateView):
                return x
            if id(x) not in windows:
                windows[id(x)] = _Window.of(x, writes=id(x) in written)
            return windows[id(x)].values

        out = func(*tree_map(plain, args), **tree_map(plain, kwargs))
        for key in written:
            windows[key].write_back()
        views = {id(windows[id(x)].values): x for x in tree_flatten((args, kwargs))[0]
                 if isinstance(x, QuantizedStateView)}
        return tree_map(lambda t: views.get(id(t), t), out)


VIEW_TYPES.append(QuantizedStateView)


def _written_args(func, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments ``func`` writes (``Tensor(a!)`` in its schema), flattened."""
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        written += tree_flatten(value)[0]
    return written


def _probe(base: QuantizedState, x: Tensor) -> Tensor:
    """A meta tensor with ``x``'s size, stride and offset over ``base``'s elements."""
    storage = torch.empty(base.numel(), dtype=base.dtype, device="meta")
    return storage.as_strided(x.shape, x.stride(), x.storage_offset())


def view_of_state(viewed: Tensor, func, args: tuple, kwargs: dict) -> Any:
    """``func`` (a view op) of ``viewed``, a state or a view of one, as views of the state: torch computes
    the sizes and strides on a meta tensor standing in for ``viewed``."""
    base = viewed.base if isinstance(viewed, QuantizedStateView) else viewed
    probe = _probe(base, viewed)
    stand_in = lambda x: probe if x is viewed else x  # noqa: E731
    out = func(*tree_map(stand_in, args), **tree_map(stand_in, kwargs))
    storage = probe.untyped_storage()._cdata

    def as_view(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if t.untyped_storage()._cdata == storage:
            return QuantizedStateView(base, t.shape, t.stride(), t.storage_offset())
        # an op that views or copies (``contiguous``), and copied: a copy of the viewed elements
        return _Window.of(viewed).copy()

    return tree_map(as_view, out)


@dataclass
class _Window:
    """The rows of a view's base it lies in (``rows``, a state aliasing them), their decoded values
    (``flat``), where the view's elements lie in ``flat`` (``size``, ``stride``, ``offset``) and what
    an op gets for the view (``values``): a strided view of ``flat`` for a read, a copy for a write
    (written back by index, which ``torch.compile`` traces, unlike a write through ``as_strided``)."""

    rows: QuantizedState
    flat: Tensor
    size: tuple
    stride: tuple
    offset: int
    values: Tensor

    @staticmethod
    def of(view: QuantizedStateView, writes: bool = False) -> "_Window":
        base = view.base
        row_len = math.prod(base.shape[1:]) if base.dim() >= 2 else base.row_len
        size, stride = tuple(view.shape), view.stride()
        if view.numel() == 0 or base.numel() == 0:
            first, stop = 0, 0
        else:
            last = view.storage_offset() + sum((n - 1) * s for n, s in zip(size, stride))
            first, stop = view.storage_offset() // row_len, last // row_len + 1
        rows = _rows(base, first, stop, row_len)
        flat = rows.dequantize().reshape(-1)
        offset = view.storage_offset() - first * row_len
        values = flat.as_strided(size, stride, offset)
        if writes:
            _check_no_overlap(view)
            values = values.clone()
        return _Window(rows, flat, size, stride, offset, values)

    def write_back(self) -> None:
        """Encode into :attr:`rows` the blocks that hold an element of the view; the others keep their bits."""
        q = self.rows
        width, bs, nb = q.row_len, q.block_size, q.scale.shape[1]
        positions = _positions(self.size, self.stride, self.offset, q.device)
        self.flat.index_put_((positions,), self.values)
        fresh = q.clone()
        fresh.copy_(self.flat.view(q.shape))
        blocks = torch.zeros(q.rows * nb, dtype=torch.bool, device=q.device)
        blocks[(positions // width * nb + positions % width // bs).reshape(-1)] = True
        blocks = blocks.view(q.rows, nb)
        per_block = bs * q.fmt.bits // 8
        code_bytes = blocks.unsqueeze(-1).expand(q.rows, nb, per_block).reshape(q.rows, -1)[:, :q.codes.shape[1]]
        q.codes.copy_(torch.where(code_bytes, fresh.codes, q.codes))
        q.scale.copy_(torch.where(blocks, fresh.scale, q.scale))

    def copy(self, device: Optional[torch.device] = None) -> QuantizedStateView:
        """A view with the same size and stride over a copy of :attr:`rows` (on ``device``)."""
        rows = self.rows.clone()
        if device is not None and torch.device(device) != rows.device:
            rows = torch.ops.aten._to_copy.default(rows, device=device)
        return QuantizedStateView(rows, self.size, self.stride, self.offset)


def _positions(size: tuple, stride: tuple, offset: int, device: torch.device) -> Tensor:
    """The flat index of each element of a view of ``size``, ``stride`` and ``offset`` (int64, ``size``)."""
    positions = torch.full((), offset, dtype=torch.int64, device=device)
    for d, (n, s) in enumerate(zip(size, stride)):
        along = [1] * len(size)
        along[d] = n
        positions = positions + (torch.arange(n, dtype=torch.int64, device=device) * s).view(along)
    return positions.expand(size)


def _check_no_overlap(view: QuantizedStateView) -> None:
    """Raise as torch does for an in-place write into a view where elements share a location (an
    ``expand``, overlapping ``unfold`` windows): only views that pass the sufficient test of strides
    sorted ascending, each past the span of the smaller ones, are written."""
    span = 0
    for n, s in sorted(((n, s) for n, s in zip(view.shape, view.stride()) if n > 1), key=lambda d: d[1]):
        if s <= span:
            raise RuntimeError(
                "unsupported operation: more than one element of the written-to tensor refers to a single "
                f"memory location (a view of shape {tuple(view.shape)}, stride {view.stride()} of a state "
                f"[{view.base.describe()}]); clone it first"
            )
        span += (n - 1) * s
    return None


def _rows(base: QuantizedState, first: int, stop: int, row_len: int) -> QuantizedState:
    """Rows ``[first, stop)`` of ``base`` as a state aliasing its parts."""
    if (first, stop) == (0, base.rows):
        return base
    numel = min(stop * row_len, base.numel()) - first * row_len
    shape = (stop - first, *base.shape[1:]) if base.dim() >= 2 else (max(numel, 0),)
    return base.with_parts(base.codes[first:stop], base.scale[first:stop], shape=shape)

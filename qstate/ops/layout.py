"""Aliasing and dim-0 layout ops: views, slices, cat, pad.

Every handler moves whole rows (or, in a 1-D state of one row, whole blocks)
of ``codes``/``scale``; none requantizes. An op that would split a block
along dim 0 raises instead of silently requantizing. Views a state cannot hold
(``t``, ``select``, slicing along dim >= 1, a ``view`` that moves rows, ...) are
:class:`~qstate.QuantizedStateView` objects over the state.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from .._api import zero_parts
from .._state import QuantizedState
from .._state_view import view_of_state
from .._op_table import register
from ._util import aten, check_dim0, check_same_kind, is_dim0


def _infer_shape(size: Sequence[int], numel: int) -> tuple[int, ...]:
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = numel // known if known else 0
    return tuple(size)


def _padding(q: QuantizedState) -> int:
    return q.rows * q.row_len - q.numel()


def _keeps_rows(q: QuantizedState, shape: tuple[int, ...]) -> bool:
    """Whether ``q`` under ``shape`` keeps its rows (the storage rules hold with the same parts)."""
    return shape == tuple(q.shape) or len(shape) <= 1 or (shape[0] == q.rows and _padding(q) == 0)


# DTensor.from_local (view_as), flatten/reshape of states, torch.compile; a shape that moves rows: a
# QuantizedStateView
@register(aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default)
def _view(func, args, kwargs):
    q, size = args[0], args[1]
    shape = _infer_shape(size, q.numel())
    if math.prod(shape) != q.numel():
        raise RuntimeError(f"view: shape {list(size)} is invalid for a state of {q.numel()} elements [{q.describe()}]")
    if not _keeps_rows(q, shape):
        return view_of_state(q, func, args, kwargs)
    return return_and_correct_aliasing(func, args, kwargs, q.with_parts(q.codes, q.scale, shape=shape))


# autograd / DTensor.from_local / torch.compile (detach and alias return the same state)
@register(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    q = args[0]
    out = q.with_parts(func(q.codes), func(q.scale), shape=q.shape)
    return return_and_correct_aliasing(func, args, kwargs, out)


def _block_cols(q: QuantizedState, start: int, stop: int) -> tuple[int, int, int, int]:
    """Byte and scale column ranges of elements ``[start, stop)`` of one row (start on a block)."""
    f = q.fmt
    return start * f.bits // 8, f.packed_width(stop), start // q.block_size, -(-stop // q.block_size)


def slice_state(q: QuantizedState, start: int, stop: int) -> QuantizedState:
    """Elements/rows ``[start, stop)`` along dim 0, aliasing ``q``'s parts."""
    stop = max(stop, start)
    if q.dim() >= 2:
        return q.with_parts(q.codes[start:stop], q.scale[start:stop], shape=(stop - start, *q.shape[1:]))
    L = q.row_len
    if start == stop:
        return q.with_parts(q.codes[:1, :0], q.scale[:1, :0], shape=(0,), row_len=0)
    if q.rows > 1 and start % L == 0:  # whole rows
        r0, r1 = start // L, -(-stop // L)
        return q.with_parts(q.codes[r0:r1], q.scale[r0:r1], shape=(stop - start,))
    row, offset = divmod(start, L) if L else (0, 0)
    inside_one_row = (stop - 1) // L == row if L else True
    if inside_one_row and offset % q.block_size == 0:
        c0, c1, s0, s1 = _block_cols(q, offset, offset + stop - start)
        return q.with_parts(q.codes[row:row + 1, c0:c1], q.scale[row:row + 1, s0:s1],
                            shape=(stop - start,), row_len=stop - start)
    raise NotImplementedError(
        f"slice: [{start}:{stop}] of a 1-D state stored as {q.rows} row(s) of {L} would split a block; "
        f"start must be a multiple of block_size={q.block_size} within a row, or of the row length {L} "
        f"[{q.describe()}]"
    )


def _bounds(q: QuantizedState, start: Optional[int], end: Optional[int]) -> tuple[int, int]:
    n = q.shape[0] if q.dim() else 1
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    return min(max(start, 0), n), min(max(end, 0), n)


# DTensor unpad (narrow; torch 2.13 sends it to the subclass whole), user narrowing
@register(aten.narrow.default)
def _narrow(func, args, kwargs):
    q, dim, start, length = args
    if not is_dim0(dim, q):
        return view_of_state(q, func, args, kwargs)
    start = start + q.shape[0] if start < 0 else start
    return return_and_correct_aliasing(func, args, kwargs, slice_state(q, start, start + length))


# DTensor unpad (narrow), FSDP2/DTensor uneven chunks, user slicing along dim 0
@register(aten.slice.Tensor)
def _slice(func, args, kwargs):
    q, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1:])[:5]
    dim, start, end, step = kwargs.get("dim", dim), kwargs.get("start", start), kwargs.get("end", end), kwargs.get("step", step)
    if not is_dim0(dim, q) or step != 1:
        return view_of_state(q, func, args, kwargs)
    out = slice_state(q, *_bounds(q, start, end))
    return return_and_correct_aliasing(func, args, kwargs, out)


#: views no row-blocked state can hold: a QuantizedStateView over the state
STRIDED_VIEW_OPS = [
    aten.t.default, aten.transpose.int, aten.permute.default, aten.select.int, aten.diagonal.default,
    aten.expand.default, aten.as_strided.default, aten.unfold.default, aten.unbind.int, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
]


# Shampoo/SOAP/Muon-style reads of a moment (m.t() @ x, m[:, :k], m.select(1, j)); DTensor's Shard(1)
@register(*STRIDED_VIEW_OPS)
def _strided_view(func, args, kwargs):
    return view_of_state(args[0], func, args, kwargs)


def _split_points(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    points, at = [], 0
    for s in sizes:
        points.append((at, at + s))
        at += s
    return points


# torch.split / torch.chunk / DTensor Shard._split_tensor along dim 0
@register(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, args, kwargs):
    q, how = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not is_dim0(dim, q):
        return view_of_state(q, func, args, kwargs)
    n = q.shape[0]
    sizes = list(how) if isinstance(how, (list, tuple)) else [min(how, n - i) for i in range(0, n, how)] or [0]
    if sum(sizes) != n:
        raise RuntimeError(f"split: sizes {sizes} do not sum to dim 0 = {n} [{q.describe()}]")
    outs = [slice_state(q, a, b) for a, b in _split_points(n, sizes)]
    return return_and_correct_aliasing(func, args, kwargs, outs)


# DTensor's gather of uneven shards (unpadding the gathered rows), user torch.chunk along dim 0
@register(aten.chunk.default)
def _chunk(func, args, kwargs):
    q, chunks = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if not is_dim0(dim, q):
        return view_of_state(q, func, args, kwargs)
    sizes = [c.shape[0] for c in torch.empty(q.shape[0], 0).chunk(chunks)]  # torch.chunk's sizes
    outs = [slice_state(q, a, b) for a, b in _split_points(q.shape[0], sizes)]
    return return_and_correct_aliasing(func, args, kwargs, outs)


# DTensor/FSDP reassembling shards along dim 0, user torch.cat of states
@register(aten.cat.default)
def _cat(func, args, kwargs):
    tensors = [t for t in args[0]]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0]
    if not all(isinstance(t, QuantizedState) for t in tensors):
        raise TypeError(f"cat: all inputs must be QuantizedState, got {[type(t).__name__ for t in tensors]}")
    check_dim0(dim, "cat", first)
    tensors = [t for t in tensors if t.numel() or t.dim() >= 2]
    if not tensors:
        return first.clone()
    for t in tensors[1:]:
        check_same_kind("cat", first, t)
        if t.dim() != first.dim() or tuple(t.shape[1:]) != tuple(first.shape[1:]):
            raise ValueError(f"cat: expected trailing shape {tuple(first.shape[1:])}, got [{t.describe()}]")
    if first.dim() >= 2:
        shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
        return first.with_parts(torch.cat([t.codes for t in tensors]), torch.cat([t.scale for t in tensors]), shape=shape)
    L = tensors[0].row_len
    segments = [seg for t in tensors for seg in _as_rows(t, L, first)]
    *head, last = segments
    if any(seg.row_len != L for seg in head):
        raise NotImplementedError(
            f"cat: 1-D pieces of {[t.numel() for t in tensors]} elements do not fill rows of {L} "
            f"[{first.describe()}]"
        )
    if last.row_len < L:
        last = pad_state(last, L - last.numel(), extend_row_to=L)
    numel = sum(t.numel() for t in tensors)
    rows = head + [last]
    return first.with_parts(torch.cat([r.codes for r in rows]), torch.cat([r.scale for r in rows]),
                            shape=(numel,), row_len=L)


def _as_rows(t: QuantizedState, L: int, first: QuantizedState) -> list[QuantizedState]:
    """A 1-D piece cut into one-row states of ``L`` elements (the last may be shorter)."""
    try:
        return [slice_state(t, a, min(a + L, t.numel())) for a in range(0, t.numel(), L)]
    except NotImplementedError:
        raise NotImplementedError(
            f"cat: a 1-D piece stored as {t.rows} row(s) of {t.row_len} cannot be cut into rows of {L} "
            f"without splitting a block of {t.block_size} [{first.describe()}]"
        ) from None


def pad_state(q: QuantizedState, extra: int, extend_row_to: Optional[int] = None) -> QuantizedState:
    """``q`` with ``extra`` zeros appended along dim 0 (new parts; ``q`` is untouched)."""
    f = q.fmt
    if q.dim() >= 2:
        codes, scale = zero_parts(f, extra, q.row_len, q.block_size, q.signed, q.device)
        return q.with_parts(torch.cat([q.codes, codes]), torch.cat([q.scale, scale]),
                            shape=(q.shape[0] + extra, *q.shape[1:]))
    numel = q.numel() + extra
    if q.rows == 1:  # grow the single row: zero codes after the data, zero scales for new blocks
        L = max(numel, extend_row_to or 0)
        return q.with_parts(*_widen_rows(q, q.numel(), L), shape=(numel,), row_len=L)
    L = q.row_len
    new_rows = -(-numel // L) - q.rows
    values = f.unpack(q.codes, L).clone()
    values[-1, q.numel() - (q.rows - 1) * L:] = f.zero_code(q.signed)
    codes, scale = zero_parts(f, new_rows, L, q.block_size, q.signed, q.device)
    return q.with_parts(torch.cat([f.pack(values), codes]), torch.cat([q.scale, scale]), shape=(numel,))


def _widen_rows(q: QuantizedState, kept: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``q``'s rows cut to their first ``kept`` elements and widened to ``width`` with
    zeros: each kept block keeps its scale (a zero changes no absmax) and its codes; the new blocks are
    zeros."""
    f, rows = q.fmt, q.rows
    codes = torch.cat([f.unpack(q.codes, q.row_len)[:, :kept],
                       torch.full((rows, width - kept), f.zero_code(q.signed), dtype=torch.uint8, device=q.device)], 1)
    kept_blocks = -(-kept // q.block_size)
    new_blocks = -(-width // q.block_size) - kept_blocks
    scale = torch.cat([q.scale[:, :kept_blocks],
                       torch.zeros((rows, new_blocks), dtype=torch.float32, device=q.device)], 1)
    return f.pack(codes), scale


def _pad_columns(q: QuantizedState, extra: int) -> QuantizedState:
    """A 2-D ``q`` with ``extra`` zeros appended to every row (new parts, the same codes)."""
    width = q.row_len + extra
    return q.with_parts(*_widen_rows(q, q.row_len, width), shape=(q.rows, width), row_len=width)


def _pad_at_ends(op: str, q: QuantizedState, pad: list, value: float, mode: Optional[str] = None) -> QuantizedState:
    """``q`` padded by ``pad`` (torch's order: last dim first); only zeros, at the end of dim 0 or (2-D)
    at the end of dim 1: the padded state holds the same codes. ``mode``: ``aten.pad``'s
    (``constant_pad_nd`` has none)."""
    ndim = max(q.dim(), 1)
    full = list(pad) + [0] * (2 * ndim - len(pad))  # torch's order: (before, after) of the last dim first
    ends = full[1::2]  # the zeros after each dim, the last dim first
    padded_dims = [d for d, e in enumerate(reversed(ends)) if e]
    allowed = {0, 1} if q.dim() == 2 else {0}
    if (mode not in (None, "constant") or value != 0 or len(full) != 2 * ndim or any(full[0::2])
            or any(e < 0 for e in ends) or not set(padded_dims) <= allowed):
        shown = "" if mode is None else f", mode={mode!r}"
        raise NotImplementedError(
            f"{op}: a QuantizedState pads only zeros at the end of dim 0 (pad=[0, ..., 0, k], "
            f"value=0) or, for 2-D states, at the end of dim 1 too, got pad={pad}{shown}, value={value} "
            f"[{q.describe()}]"
        )
    out = _pad_columns(q, ends[0]) if 1 in padded_dims else q
    return pad_state(out, ends[-1]) if ends[-1] or out is q else out


# DTensor/FSDP2 pad_tensor of uneven shards before all_gather (zeros at the end of dim 0): every rank
# that pads must pad, or the ranks that do not wait in the all-gather for one that raised
@register(aten.constant_pad_nd.default)
def _constant_pad(func, args, kwargs):
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    return _pad_at_ends("constant_pad_nd", args[0], list(args[1]), value)


# torch.nn.functional.pad (DTensor's pad_tensor calls it), as it reaches a subclass before decomposing
@register(aten.pad.default)
def _pad(func, args, kwargs):
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    value = args[3] if len(args) > 3 else kwargs.get("value", None)
    return _pad_at_ends("pad", args[0], list(args[1]), 0 if value is None else value, mode)


# LocalTensor (simulated ranks) and DTensor metadata queries: a state is its own base, offset 0
@register(aten.sym_storage_offset.default)
def _storage_offset(func, args, kwargs):
    return 0

"""Copies, moves and fresh states: copy_, _to_copy, clone, zeros_like, pinning."""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from .._library import LIBRARY
from .._api import check_nonnegative, encode_into, encode_like, row_layout, zero_parts
from .._state_kernels import kernels_for, traced_codec
from .._state import QuantizedState
from ..formats.map_formats import legacy_map_name
from .._op_table import register
from ._util import aten


def _map_parts(q: QuantizedState, fn) -> QuantizedState:
    qmap = None if q.qmap is None else fn(q.qmap)
    return q.with_parts(fn(q.codes), fn(q.scale), shape=q.shape, qmap=qmap)


def _parts(q: QuantizedState) -> list[torch.Tensor]:
    return [q.codes, q.scale] + ([] if q.qmap is None else [q.qmap])


#: what a copy between two states of different kinds or maps says instead
_CONVERT_HINT = ("copy its values (dst.copy_(src.dequantize())) or convert a state dict with "
                 "qstate.optim.convert_state_dict(state_dict, optimizer)")


def copy_into_state(dst: QuantizedState, src: torch.Tensor, draws: Optional[torch.Tensor] = None) -> QuantizedState:
    """Write ``src`` into ``dst`` in place; on any mismatch raise and leave ``dst`` unchanged (a source
    state is checked whole, :meth:`QuantizedState.check`, and parts never broadcast). ``draws``:
    stochastic rounding's draws by position for a float ``src`` (``qstate::copy_with_draws_``)."""
    if isinstance(src, QuantizedState):
        # a state from elsewhere (a checkpoint, a load): whole and valid, never broadcast
        dst.check(values=False)
        src.check(src.state_name or (f"source of {dst.state_name}" if dst.state_name else None))
        if (src.kind(), src.dtype) != (dst.kind(), dst.dtype):  # a checkpoint of another policy, too
            raise ValueError(f"copy_: expected a state of kind [{dst.describe()}], got [{src.describe()}]; "
                             f"copy_ never converts a state: {_CONVERT_HINT}")
        if tuple(src.shape) != tuple(dst.shape) or (src.rows, src.row_len) != (dst.rows, dst.row_len):
            raise ValueError(
                f"copy_: expected a state of shape {tuple(dst.shape)} stored as {dst.rows} rows of "
                f"{dst.row_len}, got shape {tuple(src.shape)} stored as {src.rows} rows of {src.row_len}"
            )
        legacy = legacy_map_name(src.qmap)
        if legacy != legacy_map_name(dst.qmap):  # codes copied as they are must index the same map
            raise ValueError(f"copy_: the source state is stored with {legacy or 'its format map'}, the destination "
                             f"[{dst.describe()}] with {legacy_map_name(dst.qmap) or 'its format map'}; "
                             f"{_CONVERT_HINT}")
        codes, scale = src.codes, src.scale
    else:
        if not src.is_floating_point():
            raise TypeError(f"copy_: a quantized state takes floating-point values, got {src.dtype} [{dst.describe()}]")
        try:
            src = src.expand(dst.shape)
        except RuntimeError:
            raise ValueError(
                f"copy_: expected a source of shape {tuple(dst.shape)}, got {tuple(src.shape)} [{dst.describe()}]"
            ) from None
        if draws is not None and tuple(draws.shape) != tuple(dst.shape):
            raise ValueError(f"copy_with_draws_: expected draws of shape {tuple(dst.shape)}, got "
                             f"{tuple(draws.shape)} [{dst.describe()}]")
        if not dst.signed:
            check_nonnegative(src, f"copy_ into {dst.state_name or 'a state'} [{dst.describe()}]")
        kernels = kernels_for(dst) if draws is None else None
        if kernels is not None and kernels.encodes(dst, src):  # the same codes and scales, in place
            kernels.encode_into(dst, src)
            return dst
        if dst.rounding == "nearest" and traced_codec(dst):  # compiled code calls the op's kernels: the same bits
            encode_into(dst, src)
            return dst
        codes, scale = encode_like(dst, src, draws if dst.rounding == "stochastic" else None)
    if codes.shape != dst.codes.shape or scale.shape != dst.scale.shape:  # never a broadcast
        raise ValueError(f"copy_: expected codes {list(dst.codes.shape)} and scales {list(dst.scale.shape)} "
                         f"(the destination's), got codes {list(codes.shape)} and scales {list(scale.shape)} "
                         f"[{dst.describe()}]")
    dst.codes.copy_(codes)
    dst.scale.copy_(scale)
    return dst


# optimizer steps writing new values into a state; load_state_dict; DTensor copy_
@register(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, QuantizedState):
        return copy_into_state(dst, src)
    src.check()  # a state read into a plain tensor: whole and valid, as one copied into a state
    return dst.copy_(src.dequantize(torch.float32))


# the optimizers' op-by-op updates writing a state whose stochastic rounding draws by position: the
# op's rule for QuantizedState (``torch.library.register_torch_dispatch``, in place of the subclass's
# ``__torch_dispatch__``)
def _copy_with_draws(cls, func, types, args, kwargs):
    dst, src, draws = args
    if isinstance(dst, QuantizedState):
        copy_into_state(dst, src, draws)
    else:  # a plain dst, a quantized src: the src's values
        src.check()
        dst.copy_(src.dequantize(torch.float32))


torch.library.register_torch_dispatch("qstate::copy_with_draws_", QuantizedState, _copy_with_draws, lib=LIBRARY)


def _copy_with_draws_plain(self: torch.Tensor, src: torch.Tensor, draws: torch.Tensor) -> None:
    """``qstate::copy_with_draws_``'s kernel for plain tensors: a plain ``copy_`` (no draws to use)."""
    self.copy_(src)


LIBRARY.impl("copy_with_draws_", _copy_with_draws_plain, "CompositeExplicitAutograd")


# Tensor.to(device) (moves the state) and Tensor.to(dtype) (reads it as plain values)
@register(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    q = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or q.device
    non_blocking = kwargs.get("non_blocking", False)
    if dtype is not None and dtype != q.dtype:
        return q.dequantize(dtype).to(device, non_blocking=non_blocking)
    out = _map_parts(q, lambda t: t.to(device, non_blocking=non_blocking))
    if kwargs.get("pin_memory"):
        out = _map_parts(out, lambda t: t.pin_memory())
    return out


# state_dict deep copies, torch.compile functionalization
@register(aten.clone.default)
def _clone(func, args, kwargs):
    return _map_parts(args[0], torch.clone)


# torch.zeros_like/empty_like of a state (optimizer state init from another state)
@register(aten.zeros_like.default, aten.empty_like.default)
def _zeros_like(func, args, kwargs):
    q = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or q.device
    if dtype is not None and dtype != q.dtype:
        return torch.zeros(q.shape, dtype=dtype, device=device)
    codes, scale = zero_parts(q.fmt, q.rows, q.row_len, q.block_size, q.signed, torch.device(device))
    qmap = None if q.qmap is None else q.qmap.to(device)
    return q.with_parts(codes, scale, shape=q.shape, qmap=qmap)


# DTensor fill_empty_tensor_to_shards (empty shards when dim 0 < world size), Tensor.new_zeros
@register(aten.new_zeros.default)
def _new_zeros(func, args, kwargs):
    q, size = args[0], tuple(args[1])
    dtype = kwargs.get("dtype")
    device = torch.device(kwargs.get("device") or q.device)
    if dtype is not None and dtype != q.dtype:
        return torch.zeros(size, dtype=dtype, device=device)
    rows, row_len = row_layout(size)
    codes, scale = zero_parts(q.fmt, rows, row_len, q.block_size, q.signed, device)
    qmap = None if q.qmap is None else q.qmap.to(device)
    return q.with_parts(codes, scale, shape=size, row_len=row_len, qmap=qmap)


# optimizer zero-init / reset of a state in place
@register(aten.zero_.default)
def _zero(func, args, kwargs):
    q = args[0]
    codes, scale = zero_parts(q.fmt, q.rows, q.row_len, q.block_size, q.signed, q.device)
    q.codes.copy_(codes)
    q.scale.copy_(scale)
    return q


# FSDP2 CPU offload (pinned host states) and DataLoader-style pinning
@register(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    return all(t.is_pinned() for t in _parts(args[0]))


# Tensor.pin_memory() of an offloaded state
@register(aten._pin_memory.default)
def _pin_memory(func, args, kwargs):
    return _map_parts(args[0], lambda t: t.pin_memory())


_ = return_and_correct_aliasing

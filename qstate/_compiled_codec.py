"""Compiled encode and decode of CUDA states: inductor's kernels of the formats' torch ops.

A CUDA state's ``copy_`` of values, its in-place math, :func:`qstate.quantize` (rounded to nearest)
and ``dequantize`` run the formats' encode and decode (:class:`~qstate.formats.BlockFormat`) compiled
by ``torch.compile`` over the state's blocks, rather than the same ops one by one. The codes, scales
and values are the eager ones, bit for bit: inductor computes the formats' ops, block by block as
they do.

Storage rules it takes: a state whose rows are whole blocks (``row_len`` a multiple of
``block_size``, no padding, at least two blocks), so that its codes and scales are those of
``[blocks, block_size]`` rows. One compile per format, signedness, block size and values dtype, for
any number of blocks (the first dim is dynamic). Other states, stochastic rounding, devices where
inductor has no Triton, and compiled code (which fuses the formats' ops itself) keep the formats'
torch ops.
"""

from __future__ import annotations

import functools
import types
from typing import Optional

import torch
from torch import Tensor

from ._state_kernels import register_state_kernels
from .formats import get_format

__all__ = ["CompiledStateKernels", "COMPILED"]


def _encode_blocks(x: Tensor, qmap: Optional[Tensor], format: str, block_size: int, signed: bool):
    return get_format(format).encode(x, block_size, signed, qmap)


def _decode_blocks(codes: Tensor, scale: Tensor, qmap: Optional[Tensor], format: str, block_size: int) -> Tensor:
    return get_format(format).decode(codes, scale, block_size, block_size, qmap)


@functools.lru_cache(maxsize=None)
def _compiled(fn, kind: tuple):
    """``fn`` compiled for one kind of state, as a code object of its own: dynamo's recompile limit
    counts per code object, and every kind is one compile."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{'_'.join(str(k) for k in kind)}")
    return torch.compile(types.FunctionType(code, fn.__globals__, code.co_name), fullgraph=True)


@functools.lru_cache(maxsize=None)
def _compiles_on(device_type: str) -> bool:
    """Whether inductor generates kernels for ``device_type`` here (C++ on CPU, Triton on CUDA)."""
    if device_type == "cpu":
        return True
    from torch.utils._triton import has_triton

    return device_type == "cuda" and has_triton()


def _whole_blocks(q) -> bool:
    """Whether ``q``'s rows are at least two whole blocks with no padding (module docstring)."""
    return (q.row_len % q.block_size == 0 and q.codes.shape[0] * q.row_len == q.numel() >= 2 * q.block_size
            and q.codes.is_contiguous() and q.scale.is_contiguous() and _compiles_on(q.codes.device.type))


class CompiledStateKernels:
    """:class:`qstate._state_kernels.StateKernels` by inductor (module docstring)."""

    def encodes(self, q, values: Tensor) -> bool:
        return (q.rounding == "nearest" and values.device == q.codes.device
                and values.dtype in (torch.float32, torch.bfloat16) and _whole_blocks(q))

    def encode_into(self, q, values: Tensor) -> None:
        x = values.detach().reshape(-1, q.block_size)
        torch._dynamo.mark_dynamic(x, 0)
        encode = _compiled(_encode_blocks, (q.format, q.block_size, q.signed, x.dtype))
        codes, scale = encode(x, q.qmap, q.format, q.block_size, q.signed)
        q.codes.view(codes.shape).copy_(codes)
        q.scale.view(scale.shape).copy_(scale)

    def decodes(self, q) -> bool:
        return _whole_blocks(q)

    def decode(self, q) -> Tensor:
        blocks = q.numel() // q.block_size
        codes, scale = q.codes.view(blocks, -1), q.scale.view(blocks, 1)
        torch._dynamo.mark_dynamic(codes, 0)
        torch._dynamo.mark_dynamic(scale, 0)
        decode = _compiled(_decode_blocks, (q.format, q.block_size))
        return decode(codes, scale, q.qmap, q.format, q.block_size).view(-1)


COMPILED = CompiledStateKernels()
register_state_kernels("cuda", COMPILED, traced=False)

"""Fused, compiled update kernels: one graph per kernel *kind*, never per shape.

A kernel kind (:class:`KernelSpec`) is the optimizer rule and its static
flags, the parameter dtype, stochastic rounding on/off, and per state either
``("plain", dtype)`` or ``("q", format, block_size)``; shapes are not part of
it. Each kind is compiled once (``fullgraph=True, dynamic=True``) from a
function with its own code object, so kinds never share dynamo's cache
entries or recompile limit.

Shape independence
------------------
* The kernels take **plain** tensors: for a :class:`~qstate.QuantizedState`
  its inner ``codes``/``scale`` (the state's Python attributes such as
  ``row_len`` never reach dynamo, so it has nothing to guard on).
* Every input is re-aliased with ``Tensor.set_`` as a fresh contiguous tensor
  of a fixed rank (1-D for plain states, ``[rows, row_len]`` for quantized
  ones), so dynamo sees neither the parameter's rank nor a view base.
* Sizes are symbolic and traced with ``backed_size_oblivious`` so that sizes
  0/1 (one-row states, one-block rows) are not specialized.
* Blocks are handled without data-dependent branches: the per-block absmax
  is a reduction over ``pad(values, to a whole number of blocks)`` and the
  per-element scale is ``scale[:, col // block_size]``; a row whose length is
  a multiple of the block size uses the same graph (its padding is empty).

Only plain ``QuantizedState`` / plain tensors on the same device take this
path; anything else (DTensor states) runs the same math eagerly, op by op
(see ``functional.py``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .._state import QuantizedState
from ..formats import get_format
from ._codec import Codec, get_codec
from ._rules import RULES, UpdateRule
from ._rounding import store_param

__all__ = ["KernelSpec", "get_kernel", "kernel_kinds", "run_fused"]


@dataclass(frozen=True)
class KernelSpec:
    rule: str
    flags: tuple  # sorted (name, value) pairs of the rule's static flags
    param_dtype: torch.dtype
    stochastic_round: bool
    states: tuple  # per state: ("plain", dtype) or ("q", format, signed, block_size)
    device_type: str

    @property
    def quantized(self) -> bool:
        return any(s[0] == "q" for s in self.states)

    def tag(self) -> str:
        parts = [self.rule, str(self.param_dtype).split(".")[-1], "sr" if self.stochastic_round else "rn"]
        parts += ["_".join(str(x) for x in s).replace("torch.", "") for s in self.states]
        return "_".join(parts).replace("-", "_")


def _alias(t: Tensor, shape: Sequence[int]) -> Tensor:
    """``t``'s storage as a fresh contiguous tensor of ``shape`` (no view base for dynamo to trace)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return out.set_(t.untyped_storage(), t.storage_offset(), tuple(shape), tuple(reversed(strides)))


# ------------------------------------------------------------------ kernel bodies
def _plain_body(spec: KernelSpec, rule: UpdateRule, flags: dict) -> Callable:
    names = rule.scalar_names

    def kernel(p: Tensor, g: Tensor, hyper: Tensor, *states: Tensor) -> None:
        h = {n: hyper[i] for i, n in enumerate(names)}
        p_new, new = rule.math(p.float(), g.float(), [s.float() for s in states], h, flags)
        for s, value in zip(states, new):
            s.copy_(value)
        store_param(p, p_new, spec.stochastic_round)

    return kernel


def _pad_cols(x: Tensor, width: Tensor | int) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _quantized_body(spec: KernelSpec, rule: UpdateRule, flags: dict, codecs: list[Codec]) -> Callable:
    names = rule.scalar_names
    fmts = [get_format(s[1]) for s in spec.states]
    block_sizes = [s[3] for s in spec.states]
    n_tables = [len(c.tables) for c in codecs]

    def kernel(p: Tensor, g: Tensor, hyper: Tensor, *flat: Tensor) -> None:
        rows, row_len = p.shape
        h = {n: hyper[i] for i, n in enumerate(names)}
        states, at = [], 0
        for n in n_tables:
            states.append((flat[at], flat[at + 1], list(flat[at + 2: at + 2 + n])))
            at += 2 + n
        p32, g32 = p.float(), g.float()

        # sizes derived from row_len only, so that dynamo relates every size to (rows, row_len)
        width = (row_len + 1) // 2  # bytes per row of a 4-bit state

        def unpacked(fmt, codes):
            if fmt.bits == 8:
                return codes
            both = torch.stack([codes & 0xF, codes >> 4], dim=-1).view(rows, 2 * width)
            return both[:, :row_len]

        def per_element(scale, bs):  # [rows, nblocks] -> [rows, row_len]
            nblocks = (row_len + bs - 1) // bs
            return scale.view(rows, nblocks, 1).expand(rows, nblocks, bs).reshape(rows, nblocks * bs)[:, :row_len]

        # previous values, per element
        prev = []
        for fmt, codec, bs, (codes, scale, tables) in zip(fmts, codecs, block_sizes, states):
            prev.append(codec.decode(unpacked(fmt, codes), tables) * per_element(scale, bs))
        p_new, new = rule.math(p32, g32, prev, h, flags)

        for fmt, codec, bs, value, (codes, scale, tables) in zip(fmts, codecs, block_sizes, new, states):
            nblocks = (row_len + bs - 1) // bs
            blocks = _pad_cols(value, nblocks * bs).view(rows, nblocks, bs)
            absmax = blocks.abs().amax(dim=-1)
            new_scale = absmax / fmt.max_code if fmt.max_code != 1.0 else absmax
            safe = torch.where(new_scale == 0, torch.ones_like(new_scale), new_scale)
            y = value / per_element(safe, bs)
            c = codec.encode(y, tables)
            if fmt.bits == 4:
                pairs = _pad_cols(c, 2 * width).view(rows, width, 2)
                c = pairs[..., 0] | (pairs[..., 1] << 4)
            codes.copy_(c)
            scale.copy_(new_scale.view(scale.shape))
        store_param(p, p_new, spec.stochastic_round)

    return kernel


# ------------------------------------------------------------------ compile once per kind
_KERNELS: dict[tuple, Callable] = {}


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own (dynamo caches per code object)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(fn.__code__, "co_qualname") \
        else fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _flags_dict(spec: KernelSpec) -> dict:
    return dict(spec.flags)


def get_kernel(spec: KernelSpec, device: torch.device, compile: bool = True) -> Callable:
    """The kernel of ``spec`` on ``device`` (compiled unless ``compile=False``)."""
    key = (spec, device.type, device.index, compile)
    fn = _KERNELS.get(key)
    if fn is None:
        rule = RULES[spec.rule]
        flags = _flags_dict(spec)
        if spec.quantized:
            codecs = [get_codec(s[1], s[2], device) for s in spec.states]
            body = _quantized_body(spec, rule, flags, codecs)
        else:
            body = _plain_body(spec, rule, flags)
        body = _own_code(body, "qstate_kernel_" + spec.tag())
        if compile:
            body = torch.compile(body, fullgraph=True, dynamic=True,
                                 options={"assert_indirect_indexing": False})
        fn = _KERNELS[key] = body
    return fn


def kernel_kinds() -> list[str]:
    """Tags of the kernels built so far in this process (one compiled graph each)."""
    return sorted({k[0].tag() + ("" if k[3] else " (eager)") for k in _KERNELS})


def state_entry(state: Tensor) -> tuple:
    """The :class:`KernelSpec` entry of one state."""
    if type(state) is QuantizedState:
        return ("q", state.format, state.signed, state.block_size)
    return ("plain", state.dtype)


def fusable(p: Tensor, g: Tensor, states: Sequence[Tensor]) -> bool:
    """Whether the fused kernels can run this update (plain tensors / plain QuantizedStates)."""
    if type(p) not in (Tensor, torch.nn.Parameter) or type(g) is not Tensor:
        return False
    if not (p.is_contiguous() and g.is_contiguous()) or g.shape != p.shape or g.device != p.device:
        return False
    for s in states:
        if type(s) is QuantizedState:
            if s.device != p.device or s.rows * s.row_len != p.numel() or s.dtype != torch.float32:
                return False
            if not (s.codes.is_contiguous() and s.scale.is_contiguous()):
                return False
            if not get_codec(s.format, s.signed, p.device).matches(s.qmap):
                return False
        elif type(s) is Tensor:
            if s.device != p.device or not s.is_contiguous() or s.shape != p.shape:
                return False
        else:
            return False
    kinds = {type(s) for s in states}
    return len(kinds) <= 1


def run_fused(spec: KernelSpec, p: Tensor, g: Tensor, states: Sequence[Tensor], hyper: Tensor,
              compile: bool = True) -> None:
    """One fused update of ``p`` and its ``states`` (``hyper``: the rule's scalars on ``p.device``)."""
    kernel = get_kernel(spec, p.device, compile)
    if spec.quantized:
        q0 = states[0]
        rows, row_len = q0.rows, q0.row_len
        flat: list[Tensor] = []
        for s in states:
            codec = get_codec(s.format, s.signed, p.device)
            flat += [_alias(s.codes, s.codes.shape), _alias(s.scale, s.scale.shape), *codec.tables]
        args = (_alias(p.detach(), (rows, row_len)), _alias(g, (rows, row_len)), hyper, *flat)
    else:
        n = (p.numel(),)
        args = (_alias(p.detach(), n), _alias(g, n), hyper, *[_alias(s, n) for s in states])
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        kernel(*args)
    # writes went through aliases: bump the version counters autograd checks
    torch.autograd.graph.increment_version(p)


_ = Optional

"""Inductor's compiled kernels: the default fused backend, one graph per kernel spec, never per shape.

Each spec (:class:`~.spec.KernelSpec`) compiles once (``fullgraph=True, dynamic=True``, a code
object of its own: specs never share dynamo's cache entries or recompile limit). Shape independence:
the kernels take plain tensors (a state's ``codes``/``scale``, never its Python attributes),
re-aliased with ``Tensor.set_`` to a fixed rank (1-D plain states, ``[rows, row_len]`` quantized
ones); sizes are symbolic (``backed_size_oblivious``, no duck shaping); the spec's Python numbers
(block sizes, table constants) are specialized.

Quantized states run in block space (:class:`_BlockSpace`): every tensor viewed as ``[N, unit]``
(``unit``: the lcm of the block sizes), aliased where rows are whole units, else zero-padded copies
whose padding is masked out of the absmax and dropped on copy-back. One loop over block rows
computes the new states, their absmax, the encode and the parameter; the new scales are returned
and copied by :func:`run_compiled`. Each block row reads only itself and the scalars, so small
parameters of one spec may run as one call over concatenated rows: the same graph, the same bits.

Results equal the format's ``copy_`` of the same values (the codecs, :mod:`qstate.formats._codec`)
and the C kernel's bit for bit, stochastic draws included (:func:`qstate._random.position_draws`).
"""

from __future__ import annotations

import threading
import types
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from ..._random import MASK64, as_int64, param_key, position_draws, position_hash32, state_key
from ...formats import block_absmax, get_format
from .backends import register_backend
from ...formats._codec import Codec, get_codec
from .prepared import PreparedUpdate
from ..rules import RULES, UpdateRule
from .spec import KernelSpec, block_unit
from .param_rounding import store_param

__all__ = ["INDUCTOR", "PreparedKernelCall", "get_kernel", "kernel_specs", "run_compiled"]


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

    def kernel(p: Tensor, g: Tensor, hyper: Tensor, place: Tensor, *states: Tensor) -> None:
        # place (param_sr specs; else unused): int64 [key, first flat index, row length]
        h = {n: hyper[i] for i, n in enumerate(names)}
        p_new, new = rule.math(p.float(), g.float(), [s.float() for s in states], h, flags)
        for s, value in zip(states, new):
            s.copy_(value)
        draws = None
        if spec.param_sr:
            index = place[1] + torch.arange(p.shape[0], dtype=torch.int64, device=p.device)
            draws = position_draws(place[0], index)
        store_param(p, p_new, spec.stochastic_round, draws)

    return kernel


def _unpacked(bits: int, codes: Tensor) -> Tensor:
    """``[N, unit * bits / 8]`` bytes -> ``[N, unit]`` codes (4-bit: low nibble first)."""
    if bits == 8:
        return codes
    n, width = codes.shape
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).view(n, 2 * width)


def _packed(bits: int, codes: Tensor) -> Tensor:
    """Inverse of :func:`_unpacked` (``unit`` is even for 4-bit formats: pairs never cross a block)."""
    if bits == 8:
        return codes
    n, unit = codes.shape
    pairs = codes.view(n, unit // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _quantized_body(spec: KernelSpec, rule: UpdateRule, flags: dict, codecs: list[Codec]) -> Callable:
    names = rule.scalar_names
    fmts = [get_format(s.format) for s in spec.states]
    block_sizes = [s.block_size for s in spec.states]
    roundings = [s.rounding for s in spec.states]
    unit = block_unit(block_sizes)
    n_tables = [len(c.tables) for c in codecs]

    def kernel(p: Tensor, g: Tensor, hyper: Tensor, limit: Tensor, place: Tensor, keys: Tensor,
               *flat: Tensor) -> list[Tensor]:
        # block space (see _BlockSpace): p [R, NB, unit]; g [N = R * NB, unit]; limit [N]: valid
        # columns of each block row (the rest is padding); per state codes [N, unit * bits / 8] and
        # scale [N, unit // block_size]. Views with explicit sizes tie every size to (R, NB).
        # place, keys (keyed specs; else unused): place int64 [N, 2], each block row's index into keys
        # (int64 [K]: draw keys, one per parameter; a batch's rows are several parameters') and the flat
        # index of its first element in its full tensor
        rows, nb = p.shape[0], p.shape[1]
        n = rows * nb
        p = p.view(n, unit)
        h = {name: hyper[i] for i, name in enumerate(names)}
        states, at = [], 0
        for fmt, bs, k in zip(fmts, block_sizes, n_tables):
            codes = flat[at].view(n, unit * fmt.bits // 8)
            scale = flat[at + 1].view(n, unit // bs)
            states.append((codes, scale, list(flat[at + 2: at + 2 + k])))
            at += 2 + k
        g = g.view(n, unit)
        valid = torch.arange(unit, dtype=torch.int32, device=p.device) < limit.view(n, 1)

        prev = []
        for fmt, codec, bs, (codes, scale, tables) in zip(fmts, codecs, block_sizes, states):
            values = codec.decode(_unpacked(fmt.bits, codes), tables).view(n, unit // bs, bs)
            prev.append((values * scale.unsqueeze(-1)).view(n, unit))
        p_new, new = rule.math(p.float(), g.float(), prev, h, flags)

        new_scales = []
        index = None  # each block row element's flat index in its full tensor (keyed specs)
        for i, (fmt, codec, bs, rounding, value, (codes, scale, tables)) in enumerate(zip(
                fmts, codecs, block_sizes, roundings, new, states)):
            # reduced as [R, NB, ., bs]: a loop nest of its own, apart from the [N, unit] element loops
            absmax = block_absmax(torch.where(valid, value.abs(), 0.0).view(rows, nb, unit // bs, bs))
            new_scale = fmt.scale_of(absmax.view(n, unit // bs))
            y = fmt.normalize(value.view(n, unit // bs, bs), new_scale)
            # padding lanes get arbitrary codes: _BlockSpace.write_back drops them
            draws = None
            if rounding == "stochastic":
                if index is None:
                    index = place[:, 1].view(n, 1) + torch.arange(unit, dtype=torch.int64, device=p.device)
                state_keys = keys[place[:, 0]] ^ _STATE_KEY_SALTS[i]
                draws = position_hash32(state_keys.view(n, 1), index).view(n, unit // bs, bs)
            codes.copy_(_packed(fmt.bits, codec.encode(y, tables, rounding, draws).view(n, unit)))
            new_scales.append(new_scale)
        draws = None
        if spec.param_sr:
            draws = position_draws(keys[place[:, 0]].view(n, 1), place[:, 1].view(n, 1)
                                   + torch.arange(unit, dtype=torch.int64, device=p.device))
        # padding keeps its value (which also keeps this write in the loops over blocks)
        store_param(p, torch.where(valid, p_new, p.float()), spec.stochastic_round, draws)
        # returned, not written: the old scales are still being read (the caller copies them)
        return new_scales

    return kernel


#: ``state_key(key, i) == key ^ _STATE_KEY_SALTS[i]`` on the kernels' int64 keys (two's complements)
_STATE_KEY_SALTS = tuple(as_int64(state_key(0, i)) for i in range(8))


# ------------------------------------------------------------------ compile once per spec
_KERNELS: dict[tuple, Callable] = {}

_INDUCTOR_OPTIONS = {"assert_indirect_indexing": False}
#: added for specs whose states all encode by one table lookup (8-bit and fp8, rounded to
#: nearest): recompute decoded states in every loop that needs them instead of storing fp32
#: copies. Where an encode is heavier (a packed 4-bit byte encodes two elements, stochastic
#: rounding draws per element), recomputing it in every loop makes inductor's CPU code
#: generation take minutes instead of seconds: for 4-bit specs with no faster step, for
#: stochastic 8-bit ones with a step 1.36x faster on CPU, where the C kernel runs them
#: anyway (benchmarks/RESULTS.md)
_RECOMPUTE_OPTIONS = {
    "realize_reads_threshold": 1000,
    "realize_opcount_threshold": 10_000,
    "realize_acc_reads_threshold": 1000,
}


def _inductor_options(spec: KernelSpec) -> dict:
    """The spec's inductor options: :data:`_RECOMPUTE_OPTIONS` where every state encodes cheaply."""
    if spec.quantized and any(get_format(s.format).bits == 4 or s.rounding == "stochastic" for s in spec.states):
        return _INDUCTOR_OPTIONS
    return {**_INDUCTOR_OPTIONS, **_RECOMPUTE_OPTIONS}


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own (dynamo caches per code object)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(fn.__code__, "co_qualname") \
        else fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _flags_dict(spec: KernelSpec) -> dict:
    return dict(spec.flags)


def get_kernel(spec: KernelSpec, device: torch.device) -> Callable:
    """The compiled kernel of ``spec`` on ``device``."""
    key = (spec, device.type, device.index)
    fn = _KERNELS.get(key)
    if fn is None:
        rule = RULES[spec.rule]
        flags = _flags_dict(spec)
        if spec.quantized:
            codecs = [get_codec(s.format, s.signed, device) for s in spec.states]
            body = _quantized_body(spec, rule, flags, codecs)
        else:
            body = _plain_body(spec, rule, flags)
        body = _own_code(body, "qstate_kernel_" + spec.tag())
        fn = _KERNELS[key] = torch.compile(body, fullgraph=True, dynamic=True, options=_inductor_options(spec))
    return fn


def kernel_specs() -> list[str]:
    """Tags of the kernels built so far in this process (one compiled graph each)."""
    return sorted({k[0].tag() for k in _KERNELS})


_LIMITS: dict[tuple, Tensor] = {}
#: per device, the ``place`` argument of specs without parameter stochastic rounding (unread)
_NO_PLACE: dict[torch.device, Tensor] = {}


def _block_limits(rows: int, row_len: int, unit: int, device: torch.device) -> Tensor:
    """``[rows * nb]`` int32: the valid (non-padding) columns of each block-space row (cached per layout)."""
    key = (rows, row_len, unit, device)
    t = _LIMITS.get(key)
    if t is None:
        nb = -(-row_len // unit)
        per_row = (row_len - unit * torch.arange(nb, dtype=torch.int32)).clamp(max=unit)
        t = _LIMITS[key] = per_row.repeat(rows).to(device)
    return t


class _BlockSpace:
    """Block-space views ``[rows * nb, per_block]`` of row-major ``[rows, width]`` tensors.

    When a row is a whole number of ``unit``-element column groups the views
    alias the tensors (no copy); otherwise each is a zero-padded copy, and
    :meth:`write_back` copies the kernel's results into the original tensors.
    """

    def __init__(self, rows: int, row_len: int, unit: int):
        self.rows, self.nb = rows, -(-row_len // unit)
        self.padded = self.nb * unit != row_len
        self._outputs: list[tuple[Tensor, Tensor]] = []

    def view(self, t: Tensor, per_block: int, output: bool, split: bool = False) -> Tensor:
        """``t`` as ``[rows * nb, per_block]`` (``[rows, nb, per_block]`` if ``split``)."""
        width = t.numel() // self.rows
        shape = (self.rows, self.nb, per_block) if split else (self.rows * self.nb, per_block)
        if not self.padded:
            out = _alias(t, shape)
        else:
            out = _alias(self.padded_rows(t, per_block), shape)
            if output:
                self._outputs.append((t.view(self.rows, width), out))
        torch._dynamo.mark_static(out, out.dim() - 1)
        return out

    def padded_rows(self, t: Tensor, per_block: int) -> Tensor:
        """A zero-padded copy of ``t``'s rows, ``[rows, nb * per_block]`` (a padded space's block rows)."""
        flat = t.view(self.rows, -1)
        return torch.nn.functional.pad(flat, (0, self.nb * per_block - flat.shape[1]))

    def refresh(self) -> None:
        """Copy the tensors into their padded copies again (a reused :class:`PreparedKernelCall`; the
        padding lanes keep what the last call wrote, which no valid lane reads)."""
        for flat, out in self._outputs:
            out.view(self.rows, -1)[:, :flat.shape[1]].copy_(flat)

    def write_back(self) -> None:
        for flat, out in self._outputs:
            flat.copy_(out.view(self.rows, -1)[:, :flat.shape[1]])


#: per thread, the two config patches of :func:`_static_config`, reused (a patch object keeps the values
#: it replaced, so threads must not share one)
_CONFIG_PATCHES = threading.local()


def _static_config():
    """Dynamo/shape settings of every kernel call (see the module docstring): a context manager pair
    made once per thread (making them took about 70 us a call, half of their cost)."""
    patches = getattr(_CONFIG_PATCHES, "pair", None)
    if patches is None:
        patches = _CONFIG_PATCHES.pair = (
            torch._dynamo.config.patch(specialize_int=True, specialize_float=True),
            torch.fx.experimental._config.patch(backed_size_oblivious=True, use_duck_shape=False))
    return patches


class PreparedKernelCall(PreparedUpdate):
    """One parameter's compiled-kernel update (:func:`run_compiled`), ready to run again (:mod:`.prepared`).

    Holds the compiled kernel and its arguments but the gradient, the scalars and the stochastic-rounding
    keys (a plain spec's place, which holds its key): the parameter and the states in block space (:class:`_BlockSpace`: aliases of their storage,
    or for rows that are not a whole number of block units zero-padded copies, refreshed from the tensors
    before each reuse and written back after each call), the block limits and, for quantized states, the
    scales the kernel's new scales are copied into. A call keeps that storage alive until it leaves the
    registry (with its parameter or a state, or replaced by its parameter's next full path, which runs
    once a tensor it holds is no longer the parameter's or a state's: :meth:`PreparedUpdate.valid`).
    A step's calls of one spec run together (:meth:`run_group`), those of small parameters in batches.
    """

    __slots__ = ("fn", "args", "space", "unit", "row_len", "scales", "odd_nibbles", "ran",
                 "rows_n", "data_at", "scale_at", "data_rows")

    # the kernel's arguments: ``(param, grad, hyper, place, *states)`` for plain specs, ``(param, grad,
    # hyper, block limits, place, keys, *states)`` for quantized ones; a call fills the gradient, the
    # scalars and a ``param_sr`` spec's key (plain specs: in its place)
    _GRAD_AT, _HYPER_AT, _PLAIN_PLACE_AT, _LIMITS_AT, _PLACE_AT, _KEYS_AT = 1, 2, 3, 3, 4, 5

    def __init__(self, spec: KernelSpec, p: Tensor, g: Tensor, states: Sequence[Tensor], start: int = 0):
        super().__init__(spec, p, g, states, start)
        self.fn = get_kernel(spec, p.device)
        self.space: Optional[_BlockSpace] = None
        self.scales: list[Tensor] = []
        unread = _no_place(p.device)  # the place and keys of specs without parameter stochastic rounding
        self.ran = False  # padded copies are fresh before the first call
        if spec.quantized:
            q0 = states[0]
            self.row_len = q0.row_len
            self.unit = block_unit([s.block_size for s in states])
            space = self.space = _BlockSpace(q0.rows, q0.row_len, self.unit)
            flat: list[Tensor] = []
            self.data_at, self.scale_at = [0], []
            for s in states:
                codec = get_codec(s.format, s.signed, p.device)
                self.scales.append(space.view(s.scale, self.unit // s.block_size, True))
                self.data_at.append(self._KEYS_AT + 1 + len(flat))  # each state's codes, then its scale
                self.scale_at.append(self._KEYS_AT + 2 + len(flat))
                flat += [space.view(s.codes, self.unit * codec.fmt.bits // 8, True), self.scales[-1], *codec.tables]
            self.rows_n = q0.rows * space.nb
            place = _row_place(start, q0.rows, q0.row_len, self.unit, p.device) if self.sr else unread
            self.args = [space.view(p.detach(), self.unit, True, split=True), None, None,
                         _block_limits(q0.rows, q0.row_len, self.unit, p.device), place, unread, *flat]
            # an odd 4-bit row ends with a zero high nibble (the kernel wrote a padding code)
            self.odd_nibbles = tuple(i for i, s in enumerate(states) if s.fmt.bits == 4 and s.row_len % 2)
        else:
            n = (p.numel(),)
            self.unit, self.row_len, self.odd_nibbles = 0, p.numel(), ()
            self.args = [_alias(p.detach(), n), None, None, unread, *[_alias(s, n) for s in states]]
            first = self._PLAIN_PLACE_AT + 1  # the states' values
            self.rows_n, self.data_at, self.scale_at = p.numel(), [0, *range(first, first + len(states))], []
        # the arguments a batch concatenates and writes back (_run_batch), by block-space rows
        self.data_rows = [self.args[at].view(self.rows_n, -1) if spec.quantized else self.args[at]
                          for at in self.data_at]

    @property
    def group(self) -> tuple:
        return ("inductor", self.spec, self.device)

    def __call__(self, p: Tensor, g: Tensor, hyper: Union[Tensor, Sequence[float]], key: int = 0) -> None:
        self.run_group([self], [p], [g], hyper, [key])

    @classmethod
    def run_group(cls, calls, params, grads, hyper, keys) -> None:
        """The calls under one entry of the compile settings (:func:`_static_config`): those of small
        parameters in batches (:func:`_batches`, :meth:`_run_batch`), the others one after another."""
        if not isinstance(hyper, Tensor):  # the C kernel's float32 values (a CPU shard's scalars)
            hyper = torch.tensor(hyper, dtype=torch.float32)
        dyn, shapes = _static_config()
        with dyn, shapes:
            for batch in _batches(calls):
                if len(batch) > 1:
                    cls._run_batch([calls[i] for i in batch], [params[i] for i in batch],
                                   [grads[i] for i in batch], hyper, [keys[i] for i in batch])
                else:
                    i = batch[0]
                    calls[i]._run(params[i], grads[i], hyper, keys[i])

    def _run(self, p: Tensor, g: Tensor, hyper: Tensor, key: int) -> None:
        args = list(self.args)
        self._refresh()
        if self.space is not None:
            args[self._GRAD_AT] = self.space.view(g, self.unit, False)
        else:
            args[self._GRAD_AT] = _alias(g, (g.numel(),))
        args[self._HYPER_AT] = hyper
        if self.sr and self.space is None:
            args[self._PLAIN_PLACE_AT] = self._plain_place(key)
        elif self.sr:
            args[self._KEYS_AT] = _int64_on([_as_key(key)], self.device)
        out = self.fn(*args)
        for scale, new_scale in zip(self.scales, out or ()):  # quantized specs return the new scales
            scale.copy_(new_scale)
        self._finish()
        # writes went through aliases: bump the version counters autograd checks
        torch.autograd.graph.increment_version(p)

    @staticmethod
    def _run_batch(calls: Sequence["PreparedKernelCall"], params: Sequence[Tensor], grads: Sequence[Tensor],
                   hyper: Tensor, keys: Sequence[int]) -> None:
        """Calls of one spec as one kernel call over concatenated copies of their tensors' block-space rows
        (1-D elements for plain specs), copied back after it: what the calls give one by one, bit for bit
        (every block row's update reads that row, its place and the scalars only), for one call's Python
        and dynamo cost instead of one per parameter. A ``param_sr`` spec's rows draw under their own
        parameter's key (``keys``) by their place in it (quantized specs only: :func:`_batches`)."""
        first = calls[0]
        sizes = [c.rows_n for c in calls]
        args = list(first.args)  # the shared ones: the tables and the (unread) place
        for c in calls:
            c._refresh()
        copies = []
        for k, at in enumerate(first.data_at):  # the parameter and the codes (plain states' values)
            rows = [c.data_rows[k] for c in calls]
            args[at] = torch.cat(rows)
            copies.append((rows, args[at]))
        for at in first.scale_at:  # the old scales (the kernel returns the new ones)
            args[at] = torch.cat([c.args[at] for c in calls])
        args[first._GRAD_AT] = torch.cat([c._grad_rows(g) for c, g in zip(calls, grads)])
        args[first._HYPER_AT] = hyper
        if first.sr:  # quantized (_batches): each row's index into the batch's keys
            args[first._PLACE_AT], args[first._KEYS_AT] = _batch_place(calls, keys)
        if first.space is not None:
            args[first._LIMITS_AT] = torch.cat([c.args[first._LIMITS_AT] for c in calls])
            # the kernel's parameter argument is [R, NB, unit]: one row of every call's block rows
            args[0] = _alias(args[0], (1, args[0].shape[0], first.unit))
            for at in (0, first._GRAD_AT, *first.data_at[1:], *first.scale_at):
                torch._dynamo.mark_static(args[at], args[at].dim() - 1)  # as _BlockSpace.view marks them
        out = first.fn(*args)
        for rows, buffer in copies:
            torch._foreach_copy_(rows, buffer.split(sizes))
        for k, new_scale in enumerate(out or ()):  # quantized specs return the new scales
            torch._foreach_copy_([c.scales[k] for c in calls], new_scale.split(sizes))
        for c in calls:
            c._finish()
        torch.autograd.graph.increment_version(list(params))

    def _grad_rows(self, g: Tensor) -> Tensor:
        """The gradient by block-space rows (zero-padded where the rows are)."""
        if self.space is None:
            return g.view(-1)
        if not self.space.padded:
            return g.view(self.rows_n, self.unit)
        return self.space.padded_rows(g, self.unit).view(self.rows_n, self.unit)

    def _refresh(self) -> None:
        """Before a call: padded copies get the tensors' values (they may have been written since the last)."""
        if self.ran and self.space is not None:
            self.space.refresh()
        self.ran = True

    def _finish(self) -> None:
        """After a call: padded copies go back into the tensors; an odd 4-bit row's padding nibble is zeroed."""
        if self.space is not None:
            self.space.write_back()
            for i in self.odd_nibbles:
                self.states[i]().codes[:, -1] &= 0x0F

    def _plain_place(self, key: int) -> Tensor:
        """A plain spec's ``place`` on the device, ``[key, start, row_len]``: what the draws hash
        (:func:`qstate._random.position_draws`)."""
        return _int64_on([_as_key(key), self.start, self.row_len], self.device)


#: per device type, the largest parameter (elements, padding included) whose prepared calls run in batches
#: (:meth:`PreparedKernelCall._run_batch`), and the most elements one batch holds: its concatenated copies,
#: made for the call and freed after it, are the memory a batch adds. A call costs about 150 us of Python and
#: dynamo on an H200 (where the kernel updates ~10M elements in that time) and 280 us on a 2-core Zen 3
#: (~25K elements with inductor's CPU code); device types not listed run every call on its own
_BATCH_LIMITS: dict[str, tuple[int, int]] = {"cpu": (1 << 16, 1 << 20), "cuda": (1 << 22, 1 << 24)}


def _batches(calls: Sequence[PreparedKernelCall]) -> list[list[int]]:
    """Indices of ``calls`` (one spec) by how they run: lists of at least two (:meth:`_run_batch`), or one.
    A call joins a batch if its parameter is at most the device's limit (:data:`_BATCH_LIMITS`), its
    gradient has the first call's dtype (the spec leaves it open; the kernel's graph does not) and its
    spec's draws, if it rounds the parameter stochastically, are placed per block row (quantized specs; a
    plain spec's are per call); a batch closes at the device's size limit."""
    limits = _BATCH_LIMITS.get(calls[0].device.type) if calls else None
    if limits is None or (calls[0].sr and calls[0].space is None) or len(calls) < 2:
        return [[i] for i in range(len(calls))]
    largest, most = limits
    out, batch, size = [], [], 0
    for i, call in enumerate(calls):
        n = call.rows_n * (call.unit or 1)
        if n > largest or call.g_dtype is not calls[0].g_dtype:
            out.append([i])
            continue
        if batch and size + n > most:
            out.append(batch)
            batch, size = [], 0
        batch.append(i)
        size += n
    if batch:
        out.append(batch)
    return out


def _as_key(key: int) -> int:
    """A 64-bit draw key as the int64 the kernels take (its two's complement)."""
    return as_int64(key & MASK64)


def _int64_on(values: list[int], device: torch.device) -> Tensor:
    """``values`` as an int64 tensor on ``device``, made in pinned memory on CUDA (the copy does not wait
    for the stream; a new host tensor each time, so an earlier copy still in flight never sees it change)."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _row_place(start: int, rows: int, row_len: int, unit: int, device: torch.device) -> Tensor:
    """A quantized ``param_sr`` call's ``place``: ``[rows * nb, 2]`` int64, each block row's index into the
    call's keys (0: its one key) and the flat index of its first element (block row (r, b) of a tensor
    starting at ``start``: ``start + r * row_len + b * unit``), made once, on ``device``."""
    nb = -(-row_len // unit)
    first = (start + torch.arange(rows, dtype=torch.int64).view(-1, 1) * row_len
             + torch.arange(nb, dtype=torch.int64) * unit).view(-1)
    return torch.stack([torch.zeros_like(first), first], dim=1).to(device)


def _batch_place(calls: Sequence[PreparedKernelCall], keys: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The quantized kernel's ``place`` and ``keys`` for a batch of ``param_sr`` calls: their places
    concatenated, each row's key index the position of its call, and the calls' keys."""
    device = calls[0].device
    place = torch.cat([c.args[PreparedKernelCall._PLACE_AT] for c in calls])
    rows = _int64_on([c.rows_n for c in calls], device)
    place[:, 0] = torch.repeat_interleave(torch.arange(len(calls), device=device), rows, output_size=len(place))
    return place, _int64_on([_as_key(k) for k in keys], device)


def _no_place(device: torch.device) -> Tensor:
    place = _NO_PLACE.get(device)
    if place is None:
        place = _NO_PLACE[device] = torch.zeros(3, dtype=torch.int64, device=device)
    return place


def run_compiled(spec: KernelSpec, p: Tensor, g: Tensor, states: Sequence[Tensor], hyper: Tensor,
                 key: Optional[int] = None, start: int = 0) -> None:
    """One update of ``p`` and its ``states`` by the compiled inductor kernel of its spec (``hyper``: the
    rule's scalars on ``p.device``), and the prepared call of this update for the next steps
    (:mod:`.prepared`). A ``keyed`` spec's draws hash ``key`` (64 bits; None:
    :func:`qstate._random.param_key` drawn now) with each element's flat index in the full tensor ``p`` is
    a part of (``start``: its first element's), as the C kernel's (:func:`qstate._random.position_draws`).
    """
    call = PreparedKernelCall(spec, p, g, states, start)
    call(p, g, hyper, (param_key() if key is None else key) if spec.keyed else 0)
    call.register()


class InductorKernels:
    """Inductor's compiled kernels as the default fused backend (:mod:`.backends`): every spec, every
    device."""

    name = "inductor"
    run = staticmethod(run_compiled)

    @staticmethod
    def supports(spec: KernelSpec, grad_dtype: torch.dtype) -> bool:
        return True


INDUCTOR = register_backend(InductorKernels())

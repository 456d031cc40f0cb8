"""Blockwise quantization formats: encode and decode, nothing else.

Storage rules every format keeps:

* a 2-D float tensor ``[R, L]`` is quantized in blocks of ``block_size`` consecutive elements of
  one row; blocks never cross rows and a row's last block may be partial;
* ``codes``: ``uint8`` ``[R, ceil(L * bits / 8)]`` (4 bits: element ``2j`` of a row in the low
  nibble of byte ``j``, ``2j + 1`` in the high one; an odd row ends with a zero nibble);
  ``scale``: ``float32`` ``[R, ceil(L / block_size)]``; a block decodes as ``value_of(codes) * scale``;
* 0 is exact (the zero code): a zero block has scale 0, and zero codes pad with exact zeros;
* unsigned formats never decode a positive input as 0 (it rounds up to the smallest positive
  code, however small: :meth:`BlockFormat.normalize`); negative inputs encode as 0;
* every format rounds to nearest, some also stochastically (:meth:`BlockFormat.supports_rounding`,
  :mod:`qstate.formats._rounding`); a value on a code (0, ``+-max_code``) encodes exactly in both;
* re-encoding is a fixed point: ``q.copy_(q.dequantize())`` keeps every code and scale bit for bit
  (a block's absmax is stored exactly, so its scale survives: :meth:`BlockFormat.scale_of`);
* a lost value is marked, never invented: a block holding an infinity has an infinite scale, one
  holding a NaN (and no infinity) a NaN scale; an infinity decodes to the infinity of its sign
  (unsigned: ``-inf`` to NaN), a NaN to NaN, and every other value of that block to NaN.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ._rounding import ROUNDINGS

__all__ = ["BlockFormat", "block_absmax", "nonzero_quotient"]


def block_absmax(magnitudes: Tensor, amax: Optional[Tensor] = None) -> Tensor:
    """Max over the last dim of ``magnitudes`` (``|x|`` of each block): ``+inf`` where a block
    holds an infinity, even beside a NaN; else NaN where it holds a NaN; else the max.

    An infinity outranks a NaN so that it keeps its sign (module docstring); ``torch.amax``
    alone would give NaN. ``amax``: ``magnitudes.amax(-1)`` where the caller has it.
    """
    amax = magnitudes.amax(-1) if amax is None else amax
    return torch.where((magnitudes == math.inf).any(-1), math.inf, amax)


def nonzero_quotient(x: Tensor, divisor: Tensor) -> Tensor:
    """``x / divisor`` (float32), with ``+-2**-149`` (the sign of the quotient, which is ``x``'s for a
    positive divisor) where the quotient underflows to 0 but ``x`` is not 0 and ``divisor`` is finite:
    its bits or 1. A finite ``x`` over an infinite divisor (a block holding an infinity) stays 0, so it
    takes the zero code and decodes as NaN (the module docstring's rule for values that lost their
    scale), never as the infinity a positive code would give."""
    y = x / divisor
    underflow = (y == 0) & (x != 0) & (divisor != math.inf)
    return (y.view(torch.int32) | underflow.to(torch.int32)).view(torch.float32)


def _all_finite_on_cpu(amax: Tensor) -> bool:
    """Whether ``amax`` is known finite without a device sync or a graph break: plain eager CPU
    tensors only, not fake or other subclass tensors, whose values cannot be read (then
    :func:`block_absmax` is ``amax`` and :meth:`BlockFormat.normalize` a division, so
    :meth:`BlockFormat.encode` skips their extra passes; elsewhere it runs them)."""
    return (type(amax) is Tensor and amax.device.type == "cpu" and not torch.compiler.is_compiling()
            and bool(amax.isfinite().all()))


def row_blocks(x: Tensor, block_size: int) -> list[Tensor]:
    """Rows ``x`` (``[R, L]``) as blocks: ``[R, L // block_size, block_size]`` over the whole
    blocks (if ``L >= block_size`` or ``L == 0``), then ``[R, 1, L % block_size]`` over the partial last blocks
    (if any). Views of ``x`` when its last dim is contiguous; never padded.

    The encode and the decode compute on these parts and join them (:func:`join_row_blocks`)
    rather than padding rows to whole blocks, viewing them as blocks and slicing the padding
    off: inside ``torch.compile`` (inductor, CPU; torch 2.13 and 2.14) that pattern reads an
    element's block as ``column // block_size`` in a loop over ``L`` columns, which inductor's
    CPU loop split cuts to ``(L // block_size) * block_size`` columns, leaving the rest of the
    output unwritten (``upstream/issues/inductor-pad-view-slice-cpu.md``). Here every loop that
    divides by the block size runs over whole blocks, and a partial block has one scale.
    """
    rows, row_len = x.shape
    whole = row_len // block_size * block_size
    parts = []
    if whole or not row_len:
        parts.append(x[:, :whole].unflatten(1, (whole // block_size, block_size)))
    if whole != row_len:
        parts.append(x[:, whole:].unsqueeze(1))
    return parts


def join_row_blocks(parts: list[Tensor]) -> Tensor:
    """Inverse of :func:`row_blocks`: blocks of rows (``[R, n, b]`` each) -> rows ``[R, L]``."""
    return _cat_columns([p.flatten(1) for p in parts])


def _cat_columns(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class BlockFormat:
    """Base of all formats: blockwise absmax scaling around a per-format code.

    Subclasses define :meth:`code_of` (normalized value -> code index/bits),
    :meth:`value_of` (codes -> normalized values), :attr:`max_code`, and
    optionally a lookup map :meth:`make_qmap`.
    """

    #: registry name, e.g. ``"8bit"``
    name: str = ""
    #: bits per code (8 or 4)
    bits: int = 8
    #: default block size
    default_block_size: int = 256
    #: largest normalized code magnitude: ``scale = absmax / max_code``
    max_code: float = 1.0

    # -- code map -----------------------------------------------------
    def make_qmap(self, signed: bool, device: torch.device | str | None = None) -> Optional[Tensor]:
        """The sorted code map (``float32 [2**bits]``), or None if the format has none."""
        return None

    def zero_code(self, signed: bool) -> int:
        """The code (``uint8`` value of one element) that decodes to exactly 0."""
        return 0

    def code_of(self, y: Tensor, signed: bool, qmap: Optional[Tensor], rounding: str = "nearest",
                draws: Optional[Tensor] = None) -> Tensor:
        """Codes (``uint8``, one per element) of normalized values ``y``, rounded per ``rounding``
        (``"stochastic"``: with ``draws``, 32-bit draws by position of ``y``'s shape, else by value;
        :mod:`qstate.formats._rounding`)."""
        raise NotImplementedError

    def supports_rounding(self, rounding: str, signed: bool) -> bool:
        """Whether :meth:`code_of` implements ``rounding`` for ``signed`` states (always ``"nearest"``)."""
        return rounding == "nearest"

    def value_of(self, codes: Tensor, qmap: Optional[Tensor]) -> Tensor:
        """Normalized ``float32`` values of unpacked ``uint8`` codes."""
        raise NotImplementedError

    def max_abs_error(self, x: Tensor, scale_per_element: Tensor, signed: bool) -> Tensor:
        """Elementwise worst-case ``|x - decode(encode(x))|`` (for tests and docs)."""
        raise NotImplementedError

    # -- block handling (shared) --------------------------------------
    def scale_of(self, absmax: Tensor) -> Tensor:
        """Block scales of block absmaxes (:func:`block_absmax`): ``absmax / max_code``.

        A format whose ``max_code`` is not 1 must make this a fixed point of decoding: the
        scale of ``fl(max_code * s)`` must be ``s`` for every ``s`` it returns (``fp8``'s is)."""
        return absmax / self.max_code if self.max_code != 1.0 else absmax

    def normalize(self, blocks: Tensor, scale: Tensor) -> Tensor:
        """Normalized values of ``blocks`` (``[..., block]``) under their ``scale`` (``[...]``).

        ``x / scale`` (``x`` itself for a zero block), except

        * where that underflows to 0 for a nonzero ``x``: the smallest subnormal of ``x``'s
          sign, ``+-2**-149`` (:func:`nonzero_quotient`), so that an unsigned state's positive
          value never takes the zero code;
        * where it is NaN, which happens only in blocks whose scale is infinite or NaN: there
          ``x`` clamped to ``[-max_code, max_code]`` (an infinity takes ``+-max_code``), 0 for a
          NaN ``x`` (see the module docstring).

        Every path that encodes (this, the compiled kernels, the C kernel's ``normalized`` and its
        vector encodes) uses this rule.
        """
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        y = nonzero_quotient(blocks, safe.unsqueeze(-1))
        lost = blocks.clamp(-self.max_code, self.max_code).nan_to_num(0.0)
        return torch.where(y.isnan(), lost, y)

    #: the largest block size (:meth:`check_block_size`)
    max_block_size: int = 2**31 - 1

    def check_block_size(self, block_size: int) -> None:
        """Raise ``ValueError`` unless ``block_size`` is an int in ``[1, max_block_size]`` (even for
        4-bit formats).

        :attr:`max_block_size` is ``2**31 - 1``, the int32 range: offsets within a block fit 32-bit
        indexing. A block never crosses a row, so a block size above the row length stores the same
        values as the row length, but encoding pads each row to whole blocks: a larger size only costs
        memory (``block_size=2**40`` would pad every row to 4 TiB of float32).
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"format '{self.name}': block_size must be a positive int, got {block_size!r}")
        if block_size > self.max_block_size:
            raise ValueError(f"format '{self.name}': block_size must be at most {self.max_block_size} (the int32 "
                             f"range; a block larger than a row only pads it), got {block_size}")
        if self.bits == 4 and block_size % 2:
            raise ValueError(
                f"format '{self.name}': block_size must be even (two codes per byte), got {block_size}"
            )

    def check_rounding(self, rounding: str, signed: bool) -> None:
        """Raise ``ValueError`` unless ``rounding`` is a mode this format implements for ``signed``."""
        if rounding not in ROUNDINGS:
            raise ValueError(f"format '{self.name}': rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
        if not self.supports_rounding(rounding, signed):
            kind = "signed" if signed else "unsigned"
            raise ValueError(f"format '{self.name}': rounding={rounding!r} is not implemented for {kind} states")

    def packed_width(self, row_len: int) -> int:
        """Bytes of ``codes`` per row of ``row_len`` elements."""
        return (row_len * self.bits + 7) // 8

    def encode(
        self, x: Tensor, block_size: int, signed: bool, qmap: Optional[Tensor], rounding: str = "nearest",
        draws: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor]:
        """Quantize rows ``x`` (``[R, L]``, any float dtype) -> ``(codes, scale)`` (``draws``: stochastic
        rounding's draws by position, ``[R, L]``, see :meth:`code_of`).

        The whole blocks of the rows and their partial last blocks are encoded apart
        (:func:`row_blocks`), without padding, and joined."""
        x = x.float()
        codes, scales = [], []
        part_draws = [None] * 2 if draws is None else row_blocks(draws, block_size)
        for blocks, block_draws in zip(row_blocks(x, block_size), part_draws):
            magnitudes = blocks.abs()
            amax = magnitudes.amax(dim=-1)
            if _all_finite_on_cpu(amax):  # the same results, without the passes non-finite blocks need
                scale = self.scale_of(amax)
                y = nonzero_quotient(blocks, torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1))
            else:
                scale = self.scale_of(block_absmax(magnitudes, amax))
                y = self.normalize(blocks, scale)
            codes.append(self.code_of(y, signed, qmap, rounding=rounding, draws=block_draws))
            scales.append(scale)
        return self.pack(join_row_blocks(codes)), _cat_columns(scales)

    def decode(
        self, codes: Tensor, scale: Tensor, row_len: int, block_size: int, qmap: Optional[Tensor]
    ) -> Tensor:
        """Dequantize ``(codes, scale)`` -> ``float32 [R, row_len]``.

        Each element is ``value_of(code) * scale`` of its block; the whole blocks and the partial
        last blocks are multiplied apart (:func:`row_blocks`) and joined."""
        values = self.value_of(self.unpack(codes, row_len), qmap)
        parts, at = [], 0
        for blocks in row_blocks(values, block_size):
            n = blocks.shape[1]
            parts.append(blocks * scale[:, at:at + n].unsqueeze(-1))
            at += n
        return join_row_blocks(parts)

    # -- 4-bit packing --------------------------------------------------
    def pack(self, codes: Tensor) -> Tensor:
        """Pack ``uint8 [R, L]`` codes into ``[R, packed_width(L)]`` bytes."""
        if self.bits == 8:
            return codes.contiguous()
        rows, row_len = codes.shape
        if row_len % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        pairs = codes.view(rows, codes.shape[1] // 2, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()

    def unpack(self, codes: Tensor, row_len: int) -> Tensor:
        """Inverse of :meth:`pack`: ``[R, packed_width(L)]`` -> ``uint8 [R, L]``."""
        if self.bits == 8:
            return codes
        rows = codes.shape[0]
        both = torch.stack([codes & 0xF, codes >> 4], dim=-1).view(rows, 2 * codes.shape[1])
        return both[:, :row_len]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, bits={self.bits}, default_block_size={self.default_block_size})"

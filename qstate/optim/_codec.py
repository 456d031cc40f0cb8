"""Per-element encode/decode of quantized codes inside the optimizer's compiled kernels.

A :class:`Codec` turns *normalized* values (``x / scale``) into ``uint8`` codes
and back, for one ``(format, signed)`` pair, with the format's exact
semantics: the codes it produces are the codes
``format.code_of(y, signed, qmap)`` produces (tests check this bit for bit),
so a state written by a compiled kernel equals one written by
``state.copy_(values)``.

Why not call ``format.code_of`` in the kernel: for map formats it is a
``searchsorted`` over the code map, which inductor runs as a separate
(non-fused, single-threaded) aten call over the whole state. Here the nearest
code comes from two table lookups: the float bits of ``|y|`` (exponent and the
top ``M`` mantissa bits, plus the sign) index a table holding the lower
candidate code ``c`` and the largest float ``t_c`` whose nearest code is still
``c``; the code is ``c + (y > t_c)``. The tables are built once per map by
bisection over float bit patterns, so ties and rounding match
``nearest_code`` exactly (including "ties go to the lower code"). Formats
whose ``code_of`` is already elementwise arithmetic (``fp8``) and formats this
module does not know use their own ``code_of``/``value_of``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats import BlockFormat, MapFormat, get_format, nearest_code

__all__ = ["Codec", "get_codec"]

#: values below 2**-_E_MIN (relative to the block's absmax) share the first table bucket
_E_MIN = 24


def _ordered_key(x: Tensor) -> Tensor:
    """Monotone int64 key of float32 values (bit pattern, sign folded)."""
    b = x.view(torch.int32).long()
    return torch.where(b < 0, -(b & 0x7FFFFFFF), b)


def _from_ordered_key(k: Tensor) -> Tensor:
    b = torch.where(k < 0, (-k) | (-0x80000000), k)
    return b.to(torch.int32).view(torch.float32)


def _code_thresholds(qmap: Tensor) -> Tensor:
    """``t[c]``: the largest float32 ``y`` in ``[-1, 1]`` with ``nearest_code(y) <= c``."""
    n = qmap.numel()
    lo = torch.full((n,), int(_ordered_key(torch.tensor([-1.0]))), dtype=torch.long)
    hi = torch.full((n,), int(_ordered_key(torch.tensor([1.0]))), dtype=torch.long)
    codes = torch.arange(n)
    while bool((lo < hi).any()):
        mid = (lo + hi + 1) // 2
        ok = nearest_code(_from_ordered_key(mid), qmap) <= codes
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    return _from_ordered_key(lo)


def build_tables(qmap: Tensor) -> tuple[Tensor, Tensor, tuple[int, int, int]]:
    """Lookup tables of a sorted code map: ``(lower code, threshold, (M, base, K))``.

    Bucket ``key(y) = clamp((bits(|y|) >> (23 - M)) - base, 0, K - 1) + K * (y < 0)``
    holds floats whose nearest code is ``c`` or ``c + 1``; ``M`` is the smallest
    mantissa width for which every bucket spans at most two codes.
    """
    qmap = qmap.detach().float().cpu()
    n = qmap.numel()
    thresholds = _code_thresholds(qmap)
    for m_bits in range(4, 14):
        shift = 23 - m_bits
        base = (127 - _E_MIN) << m_bits
        k = (127 << m_bits) - base + 1
        keys = torch.arange(k, dtype=torch.int64)
        lo_bits = (keys + base) << shift
        hi_bits = lo_bits + (1 << shift) - 1
        lo_bits[0] = 0
        lo = lo_bits.to(torch.int32).view(torch.float32)
        hi = hi_bits.to(torch.int32).view(torch.float32)
        pos = nearest_code(lo, qmap), nearest_code(hi, qmap)
        neg = nearest_code(-hi, qmap), nearest_code(-lo, qmap)
        if int((pos[1] - pos[0]).max()) <= 1 and int((neg[1] - neg[0]).max()) <= 1:
            lower = torch.cat([pos[0], neg[0]]).clamp(max=n - 2)
            return lower.to(torch.int32), thresholds[lower], (m_bits, base, k)
    raise ValueError(f"code map of {n} entries is too dense for a {_E_MIN}-exponent lookup table")


class Codec:
    """Encode/decode of normalized values for one ``(format, signed)`` on one device.

    ``tables`` are the tensors a kernel takes as inputs (in this order);
    :meth:`decode` and :meth:`encode` are traced inside the compiled kernels and
    also run eagerly.
    """

    def __init__(self, fmt: BlockFormat, signed: bool, device: torch.device):
        self.fmt = fmt
        self.signed = bool(signed)
        self.device = torch.device(device)
        qmap = fmt.make_qmap(self.signed, "cpu")
        self.qmap = None if qmap is None else qmap.clone()
        self.lookup = isinstance(fmt, MapFormat)
        self.zero_code = fmt.zero_code(self.signed)
        tables: list[Tensor] = []
        if self.qmap is not None:
            tables.append(self.qmap)
        if self.lookup:
            lower, thresholds, (self.m_bits, self.base, self.k) = build_tables(self.qmap)
            tables += [lower, thresholds]
        self.tables = [t.to(self.device) for t in tables]
        for t in self.tables:
            torch._dynamo.mark_static(t)

    @property
    def key(self) -> tuple:
        return (self.fmt.name, self.signed)

    def decode(self, codes: Tensor, tables: list[Tensor]) -> Tensor:
        """Normalized float32 values of unpacked ``uint8`` codes."""
        if self.lookup:
            return tables[0][codes.to(torch.int32)]
        return self.fmt.value_of(codes, tables[0] if tables else None)

    def encode(self, y: Tensor, tables: list[Tensor]) -> Tensor:
        """``uint8`` codes of normalized values ``y`` (== ``format.code_of(y, signed, qmap)``)."""
        if not self.lookup:
            return self.fmt.code_of(y, self.signed, tables[0] if tables else None)
        _, lower, thresholds = tables
        bits = y.abs().view(torch.int32)
        key = ((bits >> (23 - self.m_bits)) - self.base).clamp(0, self.k - 1)
        key = key + (y < 0).to(torch.int32) * self.k
        idx = lower[key] + (y > thresholds[key]).to(torch.int32)
        if not self.signed:  # as MapFormat.code_of: a positive value never takes the zero code
            idx = torch.where((idx == self.zero_code) & (y > 0), idx + 1, idx)
        return idx.to(torch.uint8)

    def matches(self, qmap: Optional[Tensor]) -> bool:
        """Whether a state's ``qmap`` is this codec's map (a state may carry its own)."""
        if (qmap is None) != (self.qmap is None):
            return False
        return qmap is None or (qmap.shape == self.qmap.shape and torch.equal(qmap.detach().cpu(), self.qmap))


_CODECS: dict[tuple, Codec] = {}


def get_codec(fmt: str, signed: bool, device: torch.device) -> Codec:
    """The (cached) codec of ``fmt``/``signed`` on ``device``."""
    device = torch.device(device)
    key = (fmt, bool(signed), device.type, device.index)
    codec = _CODECS.get(key)
    if codec is None:
        codec = _CODECS[key] = Codec(get_format(fmt), signed, device)
    return codec

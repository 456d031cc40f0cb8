"""Per-element encode/decode of normalized values (``x / scale``) inside the fused kernels.

A :class:`Codec` of one ``(format, signed)`` pair gives the codes ``format.code_of(y, signed, qmap)``
gives, bit for bit, so a state written by a fused kernel equals one written by ``state.copy_``.
For map formats the nearest code is one lookup in a packed ``int32`` table indexed by the float bits
of ``|y|`` (exponent, top mantissa bits, sign), whose entry holds the lower candidate code ``c`` and
the low bits of the largest float whose nearest code is still ``c`` (:func:`build_tables`, built once
per map by bisection over bit patterns: ties and rounding as ``nearest_code``). Formats whose
``code_of`` is already elementwise (``fp8``) use their own. Stochastic rounding starts from the
nearest code and calls :func:`~qstate.formats.stochastic_code`, as ``MapFormat.code_of`` does.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import Tensor

from ._base import BlockFormat
from ._rounding import stochastic_code
from .map_formats import MapFormat, nearest_code
from . import get_format  # noqa

__all__ = ["Codec", "get_codec"]

#: smallest and largest ``E``: normalized values below ``2**-E`` share the first table bucket
_E_RANGE = (24, 40)


def _ordered_key(x: Tensor) -> Tensor:
    """Monotone int64 key of float32 values (bit pattern, sign folded)."""
    b = x.view(torch.int32).long()
    return torch.where(b < 0, -(b & 0x7FFFFFFF), b)


def _from_ordered_key(k: Tensor) -> Tensor:
    b = torch.where(k < 0, (-k) | (-0x80000000), k)
    return b.to(torch.int32).view(torch.float32)


def _code_thresholds(qmap: Tensor) -> Tensor:
    """``t[c]``: the largest float32 ``y`` in ``[-1, 1]`` with ``nearest_code(y) <= c`` (public as
    :func:`qstate.optim.code_thresholds`).

    The rounding thresholds of a sorted code map ``qmap`` (float32, ``[-1, 1]``), found by bisection
    over float bit patterns, so they match :func:`~qstate.formats.nearest_code` exactly (ties
    included): a normalized value ``y`` rounds to nearest as the first ``c`` with ``y <= t[c]``. The
    kernels' encode tables are built from them; values within a few ulps of ``t[c]`` are where an
    inexact encode would differ."""
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


def _bits(x: Tensor) -> Tensor:
    return x.view(torch.int32).long()


def _floats(bits: Tensor) -> Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _try_table(qmap: Tensor, thresholds: Tensor, m_bits: int, e_min: int) -> Optional[Tensor]:
    """The packed table for ``(M, E)``, or ``None`` if a bucket spans more than two codes.

    Bucket ``k`` of ``|y|``'s bit patterns is ``[La, La + mask]`` with ``La = (k + base) << shift``
    (bucket 0 also holds everything below, bucket ``K - 1`` everything above); it must span
    at most two codes, and bucket 0 (whose low bits mean nothing) exactly one.
    """
    shift, mask = 23 - m_bits, (1 << (23 - m_bits)) - 1
    base = (127 - e_min) << m_bits
    k = (127 << m_bits) - base + 1
    la = (torch.arange(k, dtype=torch.int64) + base) << shift
    lo = la.clone()
    lo[0] = 0
    hi = la + mask
    lo_f, hi_f = _floats(lo), _floats(hi)
    fields = []
    # positive side: code = c + (y > t_c)  <=>  c + (low > bits(t_c) - La)
    c_lo, c_hi = nearest_code(lo_f, qmap), nearest_code(hi_f, qmap)
    # negative side (y in [-hi, -lo]): code = c + (y > t_c)  <=>  c + (|y| < |t_c|)  <=>  c + (mask - low > mask - f)
    n_lo, n_hi = nearest_code(-hi_f, qmap), nearest_code(-lo_f, qmap)
    for c, c_top in ((c_lo, c_hi), (n_lo, n_hi)):
        if int((c_top - c).max()) > 1 or int(c_top[0]) != int(c[0]):
            return None
    never = torch.full((k,), mask, dtype=torch.int64)
    t_pos = _bits(thresholds[c_lo])
    fields.append(torch.where(c_hi > c_lo, t_pos - la, never))
    t_neg = _bits(thresholds[n_lo].abs())
    fields.append(torch.where(n_hi > n_lo, mask - (t_neg - la), never))
    codes = torch.cat([c_lo, n_lo])
    field = torch.cat(fields)
    assert bool(((field >= 0) & (field <= mask)).all()) and int(codes.max()) < 256
    return ((field << 8) | codes).to(torch.int32)


def build_tables(qmap: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
    """One packed ``int32`` lookup table of a sorted code map, and its ``(M, base, K)``.

    With ``shift = 23 - M``, ``low = bits(|y|) & (2**shift - 1)`` and
    ``key(y) = clamp((bits(|y|) >> shift) - base, 0, K - 1) + K * (y < 0)``,
    ``entry = table[key]`` gives the code ``(entry & 255) + (low' > entry >> 8)``
    where ``low' = low`` for ``y >= 0`` and ``2**shift - 1 - low`` for ``y < 0``:
    each bucket (a range of bit patterns sharing the exponent and top ``M``
    mantissa bits) holds at most two codes and the threshold between them is
    stored as the low bits of the largest float whose nearest code is the lower
    one (:func:`_code_thresholds`), so the integer compare equals ``y > t_c``
    exactly. ``(M, E)`` is the smallest table for which that holds and the
    first bucket (every ``|y| < 2**-E``) has a single code.
    """
    qmap = qmap.detach().float().cpu()
    thresholds = _code_thresholds(qmap)
    for m_bits in range(4, 14):
        for e_min in range(*_E_RANGE):
            table = _try_table(qmap, thresholds, m_bits, e_min)
            if table is not None:
                base = (127 - e_min) << m_bits
                return table, (m_bits, base, (127 << m_bits) - base + 1)
    raise ValueError(f"code map of {qmap.numel()} entries is too dense for a lookup table")


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
            table, (self.m_bits, self.base, self.k) = build_tables(self.qmap)
            tables.append(table)
        self.tables = [t.to(self.device) for t in tables]
        for t in self.tables:
            torch._dynamo.mark_static(t)
        #: state maps found equal to ``qmap``: id -> (weak reference, version counter then)
        self._matched: dict[int, tuple[weakref.ref, int]] = {}

    @property
    def key(self) -> tuple:
        return (self.fmt.name, self.signed)

    def decode(self, codes: Tensor, tables: list[Tensor]) -> Tensor:
        """Normalized float32 values of unpacked ``uint8`` codes."""
        if self.lookup:
            return tables[0][codes.to(torch.int32)]
        return self.fmt.value_of(codes, tables[0] if tables else None)

    def supports(self, rounding: str) -> bool:
        """Whether :meth:`encode` implements ``rounding`` for this codec's states."""
        return self.fmt.supports_rounding(rounding, self.signed)

    def encode(self, y: Tensor, tables: list[Tensor], rounding: str = "nearest",
               draws: Optional[Tensor] = None) -> Tensor:
        """``uint8`` codes of normalized values ``y`` (== ``format.code_of(y, signed, qmap, rounding, draws)``)."""
        if not self.lookup:
            return self.fmt.code_of(y, self.signed, tables[0] if tables else None, rounding=rounding, draws=draws)
        shift = 23 - self.m_bits
        mask = (1 << shift) - 1
        bits = y.abs().view(torch.int32)
        neg = y < 0
        key = ((bits >> shift) - self.base).clamp(0, self.k - 1)
        entry = tables[1][torch.where(neg, key + self.k, key)]
        low = bits & mask
        low = torch.where(neg, mask - low, low)
        idx = (entry & 0xFF) + (low > (entry >> 8)).to(torch.int32)
        if rounding == "stochastic":
            assert self.supports(rounding), "stochastic rounding of unsigned map states is not implemented"
            idx = stochastic_code(y, idx, tables[0], draws)
        elif not self.signed:  # as MapFormat.code_of: a positive value never takes the zero code
            idx = torch.where((idx == self.zero_code) & (y > 0), idx + 1, idx)
        return idx.to(torch.uint8)

    def matches(self, qmap: Optional[Tensor]) -> bool:
        """Whether a state's ``qmap`` is this codec's map (a state may carry its own)."""
        if (qmap is None) != (self.qmap is None):
            return False
        if qmap is None:
            return True
        # a map compared before and not written since (same version counter) is still equal: each
        # step checks every state, and the comparison is several ops
        seen = self._matched.get(id(qmap))
        if seen is not None and seen[0]() is qmap and seen[1] == qmap._version:
            return True
        same = qmap.shape == self.qmap.shape and torch.equal(qmap.detach().cpu(), self.qmap)
        if same:
            key = id(qmap)
            self._matched[key] = (weakref.ref(qmap, lambda _: self._matched.pop(key, None)), qmap._version)
        return same


_CODECS: dict[tuple, Codec] = {}


def get_codec(fmt: str, signed: bool, device: torch.device) -> Codec:
    """The (cached) :class:`Codec` of ``fmt``/``signed`` on ``device`` (public as
    :func:`qstate.optim.get_codec`): the per-element encode/decode of normalized values into a
    format's ``uint8`` codes that the fused kernels trace, equal to the format's ``code_of`` /
    ``value_of`` bit for bit; ``codec.tables`` are the tensors its encode and decode take."""
    codec = _CODECS.get((fmt, signed, device))  # as asked (every step): no device object to build
    if codec is None:
        dev = torch.device(device)
        key = (fmt, bool(signed), dev.type, dev.index)
        codec = _CODECS.get(key)
        if codec is None:
            codec = _CODECS[key] = Codec(get_format(fmt), signed, dev)
        _CODECS[(fmt, signed, device)] = codec
    return codec

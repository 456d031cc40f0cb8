"""Formats whose codes index a sorted 16- or 256-entry map (``8bit``, ``4bit``).

Maps (each function's docstring says why it is this map):

* ``8bit`` unsigned: bitsandbytes' dynamic-tree map (:func:`dynamic_map`), 0 and 1 exact; codes
  equal bitsandbytes' ``quantize_blockwise`` codes;
* ``8bit`` signed: :func:`mirrored_dynamic_map`, bitsandbytes' signed map made symmetric:
  **-1 and +1 are both exact**, so a block's absmax decodes to itself whatever its sign;
* ``4bit`` signed: :func:`normal_map`, QLoRA's NF4 quantiles, 0, -1 and +1 exact;
* ``4bit`` unsigned: :func:`square_map`, ``(k / 15) ** 2``, linear in ``sqrt(v)``, 0 exact.

Every map holds 0, ``-1`` (signed) and ``+1`` exactly, so the storage rules of
:mod:`qstate.formats._base` hold. States that carry bitsandbytes' own signed map
(:data:`LEGACY_SIGNED_8BIT_MAP`, checkpoints written before the mirrored map) are refused by the
optimizers and the fused kernels; :func:`qstate.optim.convert_state_dict` rewrites them
(:func:`legacy_map_name`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._base import BlockFormat
from ._rounding import stochastic_code

__all__ = ["MapFormat", "nearest_code", "dynamic_map", "mirrored_dynamic_map", "normal_map", "square_map", "EIGHT_BIT",
           "FOUR_BIT"]


def nearest_code(y: Tensor, qmap: Tensor) -> Tensor:
    """Index of the nearest entry of the sorted ``qmap`` for each ``y``.

    Equal to ``(y[..., None] - qmap).abs().argmin(-1)`` (ties go to the lower
    index) without materializing the ``[..., len(qmap)]`` distance tensor.
    """
    hi = torch.searchsorted(qmap, y.contiguous()).clamp_(1, qmap.numel() - 1)
    lo = hi - 1
    take_lo = (y - qmap[lo]).abs() <= (qmap[hi] - y).abs()
    return torch.where(take_lo, lo, hi)


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> Tensor:
    """The dynamic (tree) quantization map of bitsandbytes, sorted, ``float32``."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = (
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
    data.append(0.0)
    data.append(1.0)
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def mirrored_dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> Tensor:
    """The signed map of the ``8bit`` format, sorted, ``float32``.

    The positive half of ``dynamic_map(True, max_exponent_bits, total_bits)`` (1.0 included), 0, and
    the negatives of that half but its smallest entry: exact -1, 0 and +1, every step between
    neighbours the same on both sides but for the two entries nearest 0 on the negative side
    (negative values under 1.6e-6 of the absmax round to 0 or to -3.25e-6).

    Why both extremes: a block's absmax element then decodes to itself whatever its sign, so
    decoding and re-encoding a state changes no code and no scale, and an EMA held at a persistent
    outlier stays at it. bitsandbytes' map has +1 but not -1: a negative absmax element is stored
    as -0.99297 times the absmax, every re-encode shrinks it by 0.7% more (-1.0 reads -0.49 after
    100 ``copy_(dequantize())``), and an EMA at a persistent negative outlier settles at a biased
    fixed point (SGD momentum 0.99 with a constant gradient -1 there: -58.5 instead of -100).
    """
    positive = dynamic_map(True, max_exponent_bits, total_bits)
    positive = positive[positive > 0]
    return torch.cat([-positive[1:].flip(0), torch.zeros(1), positive])


#: bitsandbytes' signed dynamic map, ``dynamic_map(True, 7, 8)``: the signed ``8bit`` map of
#: checkpoints written before :func:`mirrored_dynamic_map` (no -1). Never used to encode.
LEGACY_SIGNED_8BIT_MAP = dynamic_map(True, 7, 8)
_LEGACY_MAPS = {"the signed 8bit map of bitsandbytes' create_dynamic_map(True, 7, 8) (no -1)": LEGACY_SIGNED_8BIT_MAP}


def legacy_map_name(qmap: Optional[Tensor]) -> Optional[str]:
    """A description of ``qmap`` if it is a map that states no longer use (:data:`LEGACY_SIGNED_8BIT_MAP`),
    else ``None``.

    A state carries its map (``QuantizedState.qmap``); a state stored with a legacy map decodes
    correctly with it, but no format encodes with it any more, so loading one into an optimizer
    must fail and point at :func:`qstate.optim.convert_state_dict`, which re-encodes it. Loaders call
    this on each state's map (a plain tensor; a DTensor state's local map).
    """
    if type(qmap) is not Tensor or qmap.dim() != 1 or qmap.device.type == "meta" or torch.compiler.is_compiling():
        return None  # no map, or one whose values cannot be read (fake, meta, traced)
    for name, legacy in _LEGACY_MAPS.items():
        if qmap.numel() == legacy.numel() and torch.equal(qmap.detach().to("cpu", torch.float32), legacy):
            return name
    return None


#: QLoRA's outermost NF4 quantile, ``1 - (1/32 + 1/30) / 2`` (rounded as QLoRA has it)
NF4_OFFSET = 0.9677083


def normal_map(offset: float = NF4_OFFSET) -> Tensor:
    """The 16-entry "NormalFloat" map (NF4 of QLoRA), sorted, ``float32``.

    Quantiles ``Phi^-1(p)`` of a standard normal at 8 equally spaced ``p`` in
    ``[offset, 0.5)`` (positive side) and 7 in the same range (negative side),
    plus an exact 0, divided by the largest: 7 negative and 8 positive
    entries, with 0, -1 and +1 exact; steps grow from 0.08 near 0 to 0.30
    next to -1 (QLoRA's NF4 constants to within 1e-6).

    Why not the 4-bit dynamic map (``dynamic_map(True, 3, 4)``, used by "Memory Efficient
    Optimizers with 4-bit States" and torchao): its 16 entries spend two levels per sign on
    ``|x| < 0.035 * absmax`` and leave steps of 0.135 .. 0.225 where a first moment's mass lies,
    and it has +1 but not -1 (a negative absmax decodes 11% short). With round-to-nearest an EMA
    whose increment is under half a step never moves its code, so coarse steps there make it lag;
    stochastic rounding (the optimizers' default for signed 4bit states) keeps it moving on average.
    """
    if not 0.5 < offset < 1.0:
        raise ValueError(f"normal_map: offset must be in (0.5, 1), got {offset!r}")
    q = torch.special.ndtri
    pos = q(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -q(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return (values / values.abs().max()).float()


def square_map(entries: int = 16) -> Tensor:
    """The unsigned map ``(k / (entries - 1)) ** 2``, ``k = 0 .. entries - 1``, sorted, ``float32``.

    Linear in ``sqrt(x)``: for a second moment ``v`` rounded to the nearest entry, the decoded
    ``sqrt(v)``, which divides Adam's update, is within 0.59 of a linear step (``1 / (entries - 1)``
    of the block's ``sqrt(absmax)``) of its value where ``v`` is at least the smallest positive
    entry, ``1 / (entries - 1) ** 2`` of the block's absmax, and within one step below it. Exact 0
    and 1.

    Why: within a block ``v`` spans decades (one large gradient sets the absmax); a map linear in
    ``v`` decodes every ``v`` under 1/30 of the absmax as 1/15 of it, so ``sqrt(v)`` comes back too
    large and the update too small (by up to 4 times at 1/225 of the absmax).
    """
    if entries < 2:
        raise ValueError(f"square_map: entries must be >= 2, got {entries!r}")
    return torch.linspace(0, 1, entries, dtype=torch.float64).square().float()


class MapFormat(BlockFormat):
    """Blockwise absmax scaling + an entry of a sorted code map.

    ``rounding="nearest"`` takes the nearest entry (ties to the lower code);
    ``rounding="stochastic"`` (signed maps only: an unsigned state must never
    round a positive value down to its zero code) one of the two entries
    around the value, unbiased (:func:`~qstate.formats._rounding.stochastic_code`).
    """

    max_code = 1.0

    def __init__(self, name: str, bits: int, default_block_size: int, signed_map: Tensor, unsigned_map: Tensor):
        self.name = name
        self.bits = bits
        self.default_block_size = default_block_size
        for m in (signed_map, unsigned_map):
            assert m.numel() == 2**bits and bool((m.diff() >= 0).all()) and bool((m == 0).any())
        assert bool((signed_map.diff() > 0).all()), "stochastic rounding needs a strictly increasing signed map"
        self._maps = {True: signed_map, False: unsigned_map}
        # python ints, so that tracing never touches the maps
        self._zero_codes = {s: int((m == 0).nonzero()[0, 0]) for s, m in self._maps.items()}

    def zero_code(self, signed: bool) -> int:
        return self._zero_codes[bool(signed)]

    def make_qmap(self, signed: bool, device: torch.device | str | None = None) -> Optional[Tensor]:
        return self._maps[bool(signed)].to(device)

    def supports_rounding(self, rounding: str, signed: bool) -> bool:
        return rounding == "nearest" or (rounding == "stochastic" and bool(signed))

    def code_of(self, y: Tensor, signed: bool, qmap: Optional[Tensor], rounding: str = "nearest",
                draws: Optional[Tensor] = None) -> Tensor:
        assert qmap is not None
        idx = nearest_code(y, qmap)
        if rounding == "stochastic":
            assert signed, "stochastic rounding of unsigned map states is not implemented"
            idx = stochastic_code(y, idx, qmap, draws)
        elif not signed:
            # positive values never decode as 0: bump the zero code to the next (smallest positive) one
            zero = self.zero_code(False)
            idx = torch.where((idx == zero) & (y > 0), idx + 1, idx)
        return idx.to(torch.uint8)

    def value_of(self, codes: Tensor, qmap: Optional[Tensor]) -> Tensor:
        assert qmap is not None
        return qmap[codes.long()]

    def max_abs_error(self, x: Tensor, scale_per_element: Tensor, signed: bool) -> Tensor:
        qmap = self._maps[bool(signed)].double()
        lo = -1.0 if signed else 0.0
        edges = torch.cat([torch.tensor([lo], dtype=torch.float64), qmap, torch.tensor([1.0], dtype=torch.float64)])
        gaps = edges.diff()
        worst = float(gaps[1:-1].max()) / 2
        worst = max(worst, float(gaps[0]), float(gaps[-1]))
        if not signed:  # round-up of tiny positives costs up to the whole first gap
            zero = self.zero_code(False)
            worst = max(worst, float(qmap[zero + 1] - qmap[zero]))
        return scale_per_element * worst


EIGHT_BIT = MapFormat("8bit", 8, 256, mirrored_dynamic_map(7, 8), dynamic_map(False, 7, 8))
FOUR_BIT = MapFormat("4bit", 4, 128, normal_map(), square_map())

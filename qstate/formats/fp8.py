"""``fp8``: blockwise scale + ``float8_e4m3fn`` codes (stored as their ``uint8`` bits).

Storage rules (beside :mod:`qstate.formats._base`'s):

* ``scale = fl(fl(448 * s0) / 448)`` with ``s0 = fl(absmax / 448)`` (:meth:`Float8Format.scale_of`),
  so a block's largest element decodes within ``2**-22`` of itself and re-encoding keeps the scale;
  the others keep 3 mantissa bits, down to the subnormal step ``2**-9 * scale``;
* codes are torch's ``float8_e4m3fn`` conversion of the value clamped to ``[-448, 448]``: a value
  past 448, an infinity included, takes 448's code, and only NaN takes a NaN code (the same on
  every torch version and in the C kernel);
* unsigned states round a positive value below ``2**-9 * scale`` up to it, never to 0;
* signed states round to nearest; unsigned states also round stochastically, on the sorted map
  of the non-negative finite codes (:data:`NON_NEGATIVE_VALUES`); decoding never depends on the
  rounding.

Range: a block holds values down to ``absmax * 2**-17.8``; a block whose absmax is below
``448 * 2**-149`` has a scale that underflows to 0 or to a coarse subnormal.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._base import BlockFormat
from ._rounding import stochastic_code

__all__ = ["Float8Format", "FP8"]

_E4M3 = torch.float8_e4m3fn
_SMALLEST_SUBNORMAL_BITS = 1  # 0x01 == 2**-9
#: the values of the non-negative finite codes 0x00..0x7e (0, 2**-9, ..., 448), sorted: the map that
#: unsigned states round stochastically on (the code of y >= 0 is its index here)
NON_NEGATIVE_VALUES = torch.arange(127, dtype=torch.uint8).view(_E4M3).float()


class Float8Format(BlockFormat):
    name = "fp8"
    bits = 8
    default_block_size = 256
    max_code = float(torch.finfo(_E4M3).max)

    def scale_of(self, absmax: Tensor) -> Tensor:
        """``fl(fl(448 * s0) / 448)``, ``s0 = fl(absmax / 448)``: the scale re-encoding keeps.

        A decoded block's absmax is ``fl(448 * scale)``; ``fl(absmax / 448)`` alone would give back
        a scale one ulp off for 16% of scales, so every re-encode could move it. The map
        ``s -> fl(fl(448 * s) / 448)`` is idempotent (checked for every float32 mantissa, and it
        commutes with powers of two down to subnormal scales, which it keeps), so the scale of
        ``fl(448 * scale)`` is ``scale`` again. ``0``, ``inf`` and NaN stay what they are; every
        ``absmax`` up to float32's largest keeps a finite scale.
        """
        s0 = absmax / self.max_code
        return (s0 * self.max_code) / self.max_code

    def supports_rounding(self, rounding: str, signed: bool) -> bool:
        """Nearest for every state; stochastic for unsigned states.

        Stochastic rounding (:func:`~qstate.formats._rounding.stochastic_code`) runs on the sorted
        map of the 127 non-negative finite codes ``0x00..0x7e`` (the code of ``y >= 0`` is its index
        there): a positive ``y`` takes the code below or above it so that the expected decoded
        value is ``y`` (past 448: 448's code), then the never-0 rule (below ``2**-9``: ``0x01``);
        ``y <= 0`` and NaN keep their nearest codes. Why unsigned states: a second moment's
        per-step change (``1 - beta2`` of its value) is far below half the 3-bit mantissa's step
        (``2**-5`` relative), so round-to-nearest writes most of them back unchanged and they stop
        tracking the gradients; stochastic rounding keeps each one's expectation.
        """
        return rounding == "nearest" or (rounding == "stochastic" and not signed)

    def code_of(self, y: Tensor, signed: bool, qmap: Optional[Tensor], rounding: str = "nearest",
                draws: Optional[Tensor] = None) -> Tensor:
        """Codes of normalized ``y``: ``y`` clamped to ``[-448, 448]``, then torch's conversion.

        The clamp keeps every torch version's codes, and the C kernel's, the same (torch 2.13's
        conversion saturates by itself; older ones, 2.11 among them, give NaN from 480 up). A ``y``
        past 448 happens only where the scale is subnormal (a block's absmax under
        ``448 * 2**-126``), since ``absmax / 448`` is then coarse."""
        assert self.supports_rounding(rounding, signed), (rounding, signed)
        codes = y.clamp(-self.max_code, self.max_code).to(_E4M3).view(torch.uint8)
        if not signed:
            codes = torch.where((codes == 0) & (y > 0), _SMALLEST_SUBNORMAL_BITS, codes)
            codes = torch.where(y < 0, 0, codes).to(torch.uint8)
        if rounding == "stochastic":
            positive = y > 0
            # a positive y's nearest code is in [0x01, 0x7e]: its index in the map
            nearest = torch.where(positive, codes, _SMALLEST_SUBNORMAL_BITS).long()
            rounded = stochastic_code(y, nearest, NON_NEGATIVE_VALUES.to(y.device), draws)
            rounded = rounded.clamp_min(_SMALLEST_SUBNORMAL_BITS)  # never 0 for y > 0
            codes = torch.where(positive, rounded, codes).to(torch.uint8)
        return codes

    def value_of(self, codes: Tensor, qmap: Optional[Tensor]) -> Tensor:
        return codes.view(_E4M3).float()

    def max_abs_error(self, x: Tensor, scale_per_element: Tensor, signed: bool) -> Tensor:
        """Round-to-nearest's bound: half a code step (``2**-4`` relative) plus the subnormal step; stochastic
        rounding (unsigned states) may take the other neighbour: up to a whole step (``2**-3`` relative)."""
        subnormal = scale_per_element * 2.0**-9
        return x.abs() * 2.0**-4 + subnormal


FP8 = Float8Format()

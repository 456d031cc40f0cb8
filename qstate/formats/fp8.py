"""``fp8``: blockwise scale + ``float8_e4m3fn`` codes (stored as their ``uint8`` bits).

``scale = fl(fl(448 * s0) / 448)`` with ``s0 = fl(absmax / 448)`` (448 is
e4m3fn's largest finite value; :meth:`Float8Format.scale_of`), so a block's
largest element decodes to ``fl(448 * scale)``, within ``2**-22`` of itself,
and the others keep 3 mantissa bits
(relative error <= 2**-4), down to the subnormal step ``2**-9 * scale``.
Unsigned states round a positive value below that step up to it, never to 0.
Codes are torch's ``float8_e4m3fn`` conversion of the value clamped to
``[-448, 448]``: a value past 448, an infinity included, takes 448's code,
and only NaN takes a NaN code. (torch 2.13's conversion saturates by
itself; older ones, 2.11 among them, give NaN from 480 up, so the clamp
keeps every version's codes, and the C kernel's, the same.) Past 448
happens where the scale is subnormal (a block's absmax under
``448 * 2**-126``): ``absmax / 448`` is then coarse (absmax
``1000 * 2**-149`` has the scale ``2 * 2**-149``, and that element is 500
scales).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._base import BlockFormat

__all__ = ["Float8Format", "FP8"]

_E4M3 = torch.float8_e4m3fn
_SMALLEST_SUBNORMAL_BITS = 1  # 0x01 == 2**-9


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

    def code_of(self, y: Tensor, signed: bool, qmap: Optional[Tensor], rounding: str = "nearest",
                draws: Optional[Tensor] = None) -> Tensor:
        assert rounding == "nearest", rounding  # supports_rounding: nearest only
        codes = y.clamp(-self.max_code, self.max_code).to(_E4M3).view(torch.uint8)
        if not signed:
            codes = torch.where((codes == 0) & (y > 0), _SMALLEST_SUBNORMAL_BITS, codes)
            codes = torch.where(y < 0, 0, codes).to(torch.uint8)
        return codes

    def value_of(self, codes: Tensor, qmap: Optional[Tensor]) -> Tensor:
        return codes.view(_E4M3).float()

    def max_abs_error(self, x: Tensor, scale_per_element: Tensor, signed: bool) -> Tensor:
        subnormal = scale_per_element * 2.0**-9
        return x.abs() * 2.0**-4 + subnormal


FP8 = Float8Format()

"""Rounding modes of normalized values onto a sorted code map: ``nearest`` and ``stochastic``.

A state's rounding mode is fixed at construction (``QuantizedState.rounding``);
this module holds the one implementation of stochastic rounding, shared by
the eager encode (``MapFormat.code_of``) and the compiled kernels
(``qstate.optim._codec.Codec.encode``), which both call
:func:`stochastic_code` with the nearest code they computed their own way.

Stochastic rounding (the spec; a C implementation must follow it bit for bit)
-----------------------------------------------------------------------------
For a normalized ``float32`` value ``y`` and a sorted map ``qmap`` of ``n``
entries:

1. ``h = lowbias32(bits(y))``: ``bits(y)`` is ``y``'s float32 bit pattern as
   an unsigned 32-bit integer, hashed with Chris Wellons' ``lowbias32``
   (all arithmetic mod ``2**32``, logical shifts)::

       x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16

2. ``c``: the largest code with ``qmap[c] <= y``, clamped to ``[0, n - 2]``
   (0 for ``y`` below ``qmap[0]``: the signed 8bit map has no -1);
   ``lo = qmap[c]``, ``hi = qmap[c + 1]``.
3. The code is ``c + 1`` if ``y >= hi``, ``c`` if ``y <= lo``, and otherwise
   ``c + 1`` iff ``float(h >> 8) * (hi - lo) < (y - lo) * 2**24``, evaluated
   in float32 with IEEE round-to-nearest-even, each product and difference
   rounded on its own (no fused multiply-add; ``float(h >> 8)`` is exact).

Properties:

* unbiased: over ``h`` uniform in ``[0, 2**32)``, ``P(c + 1) = (y - lo) / (hi
  - lo)`` up to float32 rounding (``2**-24`` relative), so the expected
  decoded value is ``y``;
* values on a map entry encode exactly, with no randomness: 0 and -0.0
  (zero blocks, padding), and ``+-1`` (a block's absmax, so ``scale`` is
  unaffected); values outside ``[qmap[0], qmap[n - 1]]`` take the end code;
* a pure function of ``y``'s bits: no random state, no step counter, no
  position. Sharding, slicing, the world size and the execution path
  (eager, compiled, C) never change the decision for a given ``y`` (the
  paths may compute ``y`` itself differently in the last bit: ATen's lerp
  uses a fused multiply-add, for one). Equal normalized values get
  equal decisions: a value that recurs bit for bit (an EMA whose gradient
  and decoded state repeat exactly) rounds the same way every time. On real
  gradients ``y`` changes every step, so the decisions decorrelate (the
  digits convergence test meets its target without a step-dependent salt).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROUNDINGS", "lowbias32", "lowbias32_int", "stochastic_code"]

#: rounding modes of a quantized state; the first is the default
ROUNDINGS = ("nearest", "stochastic")

#: the low 32 bits: lowbias32 runs on 32-bit words held in int64
MASK32 = 0xFFFFFFFF
#: ``0x846ca68b - 2**32``: the same product mod ``2**32``, and ``|x * k| < 2**63`` for ``x < 2**32``
_K2_SIGNED = 0x846CA68B - (1 << 32)


def lowbias32(y: Tensor) -> Tensor:
    """``lowbias32(bits(y))`` for float32 ``y``, as int64 values in ``[0, 2**32)``."""
    return lowbias32_int(y.view(torch.int32).long() & MASK32)


def lowbias32_int(x: Tensor) -> Tensor:
    """``lowbias32(x)`` of int64 ``x`` in ``[0, 2**32)``, as int64 values in ``[0, 2**32)``.

    Runs in int64 with a 32-bit mask after each multiply: every product stays
    below ``2**63`` in magnitude (no overflow), and shifts of non-negative
    values are logical. Shifts are ``torch.bitwise_right_shift``, not ``>>``:
    DTensor (torch 2.13, 2.14) returns ``x >> k`` (``aten.__rshift__``) as ``x``.
    """
    x = x ^ torch.bitwise_right_shift(x, 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ torch.bitwise_right_shift(x, 15)
    x = (x * _K2_SIGNED) & MASK32
    return x ^ torch.bitwise_right_shift(x, 16)


def stochastic_code(y: Tensor, nearest: Tensor, qmap: Tensor) -> Tensor:
    """Stochastically rounded codes of normalized ``y`` (float32) on the sorted ``qmap``.

    ``nearest`` holds the nearest codes of ``y`` (any integer dtype; the
    result has the same dtype): the largest code below is ``nearest`` or
    ``nearest - 1``, so one compare finds it. Implements the module's spec;
    ``qmap`` must be strictly increasing.
    """
    n = qmap.numel()
    floor = nearest - (qmap[nearest] > y).to(nearest.dtype)
    c = floor.clamp(0, n - 2)
    lo, hi = qmap[c], qmap[c + 1]
    draw = (lowbias32(y) >> 8).float()
    up = (y >= hi) | ((y > lo) & (draw * (hi - lo) < (y - lo) * float(1 << 24)))
    return c + up.to(c.dtype)


"""Rounding modes of normalized values onto a sorted code map: ``nearest`` and ``stochastic``.

A state's rounding mode is fixed at construction (``QuantizedState.rounding``) and applies to
every write. This module holds the one specification of stochastic rounding, in
:func:`stochastic_code`'s docstring; every encode that rounds stochastically (eager, compiled, C)
follows it bit for bit. Its invariants:

* unbiased: the expected decoded value is ``y``, up to float32 rounding;
* a value on a map entry, or one float away from one, encodes as that entry with no randomness
  (0, ``+-1``, a decoded value normalized again), so re-encoding a decoded state is a fixed point,
  as with ``nearest``; values outside the map take its end codes;
* by position (the optimizers' updates), the decision depends on the value, a per-step key and
  the element's flat index only: never on sharding, world size or execution path;
* by value (``qstate.quantize``, ``copy_``), it is a pure function of the value's float32 bits.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._random import lowbias32

__all__ = ["ROUNDINGS", "float_rank", "stochastic_code"]

#: rounding modes of a quantized state; the first is the default
ROUNDINGS = ("nearest", "stochastic")


def float_rank(v: Tensor) -> Tensor:
    """The rank of float32 ``v`` among the float32 values (int64; the spec's ``r``): ``bits(v)`` for
    ``v >= 0``, ``-(bits(v) & 0x7fffffff)`` below, so neighbouring floats differ by 1 and both zeros rank 0."""
    b = v.view(torch.int32).long()
    return torch.where(b < 0, -(b & 0x7FFFFFFF), b)


def stochastic_code(y: Tensor, nearest: Tensor, qmap: Tensor, draws: Optional[Tensor] = None) -> Tensor:
    """Stochastically rounded codes of normalized ``y`` (float32) on the sorted ``qmap``.

    ``nearest`` holds the nearest codes of ``y`` (any integer dtype; the
    result has the same dtype): the largest code below is ``nearest`` or
    ``nearest - 1``, so one compare finds it. ``draws``: the 32-bit draws
    ``h`` by position (int64 in ``[0, 2**32)``, ``y``'s shape); None draws by
    value. ``qmap`` must be strictly increasing.

    The specification (a C implementation must follow it bit for bit), for a normalized
    ``float32`` value ``y`` and a sorted map ``qmap`` of ``n`` entries:

    1. ``h``, a 32-bit draw (all arithmetic mod ``2**32``, logical shifts), from Chris Wellons'
       ``lowbias32``: ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``.

       * **by position** (the optimizers' updates, every path): given a 64-bit ``key`` (one per
         parameter and step, from the optimizer's rounding stream) and each element's flat index
         ``n`` in the full tensor, ``h = position_hash32(state_key(key, i), n)`` for the update's
         state ``i`` (:mod:`qstate._random`: ``lowbias32(n_lo ^ k_lo ^ lowbias32(n_hi ^ k_hi))``
         of the 32-bit halves; ``state_key``: ``key ^ (i + 1) * 0x9e3779b97f4a7c15`` mod ``2**64``);
       * **by value** (no draws: ``qstate.quantize``, ``copy_`` into a state):
         ``h = lowbias32(bits(y))``, ``y``'s float32 bit pattern.

    2. ``c``: the largest code with ``qmap[c] <= y``, clamped to ``[0, n - 2]``;
       ``lo = qmap[c]``, ``hi = qmap[c + 1]``.
    3. With ``r`` the rank of :func:`float_rank`, the code is ``c + 1`` if ``r(y) >= r(hi) - 1``,
       else ``c`` if ``r(y) <= r(lo) + 1``, and otherwise ``c + 1`` iff
       ``float(h >> 8) * (hi - lo) < (y - lo) * 2**24``, evaluated in float32 with IEEE
       round-to-nearest-even, each product and difference rounded on its own (no fused
       multiply-add; ``float(h >> 8)`` is exact).

    Properties: over ``h`` uniform in ``[0, 2**32)``, ``P(c + 1) = (y - lo) / (hi - lo)`` up to
    ``2**-24`` relative, so the expected decoded value is ``y``. Values on an entry or one float
    away encode as that entry: 0 and -0.0, ``+-1`` (so ``scale`` is unaffected), and ``(q * s) / s``
    for an entry ``q`` and scale ``s`` (two roundings of at most ``2**-24`` each, where ``q * s`` is
    normal), so re-encoding is a fixed point. By position, a ``y`` that differs in its last bits
    (gradients summed in another order) changes code only where the difference crosses the
    draw's threshold ``lo + u (hi - lo)``, about as rarely as it crosses round-to-nearest's
    midpoint; the key changes every step, so a value held still (an EMA moving by less than a map
    step) still rounds up and down in the right proportion over steps. By value, equal values get
    equal decisions and any change of ``y``, its last bit included, draws anew.
    """
    n = qmap.numel()
    floor = nearest - (qmap[nearest] > y).to(nearest.dtype)
    c = floor.clamp(0, n - 2)
    lo, hi = qmap[c], qmap[c + 1]
    draw = ((lowbias32(y) if draws is None else draws) >> 8).float()
    rank = float_rank(y)
    up = (rank >= float_rank(hi) - 1) | ((rank > float_rank(lo) + 1) & (draw * (hi - lo) < (y - lo) * float(1 << 24)))
    return c + up.to(c.dtype)


"""What a dtype change does to a pending reduction: one answer for every rule of the package.

``Partial(op)`` holds one addend per rank; the rules that change a tensor's dtype ask whether the
ranks may change it before the reduction, ``op(cast(x_i)) == cast(op(x_i))``, and reduce first
otherwise (one all-reduce of the input).
"""

from __future__ import annotations

import torch

__all__ = ["cast_commutes_with_reduction", "is_integer"]


def is_integer(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is an integer dtype (``bool`` is not)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _holds(dst: torch.dtype, src: torch.dtype) -> bool:
    """Whether every ``src`` value is a ``dst`` value (integers: range; floats: range and precision)."""
    info = torch.iinfo if is_integer(src) else torch.finfo
    wide, narrow = info(dst), info(src)
    exact = info is torch.iinfo or wide.eps <= narrow.eps
    return exact and wide.min <= narrow.min and narrow.max <= wide.max


def cast_commutes_with_reduction(reduce_op: str, src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ranks may cast their ``Partial(reduce_op)`` addends from ``src`` to ``dst`` before the
    reduction.

    * ``max``/``min``: through monotone casts, which never reorder values: float rounding, integer or
      ``bool`` to float, ``bool`` to integer, and integer to integer where ``dst`` holds every ``src``
      value (a narrowing integer cast wraps: ``uint8(max(256, 255)) == 0``, ``max(uint8(256), 255)
      == 255``); float to integer is undefined outside ``dst``'s range (``uint8(-1.0)`` is 255 on
      x86), so it reduces first;
    * ``sum``: through integer wrap-around (to an integer dtype no wider: exact mod ``2**k``) and
      through widening float casts; ``avg``: through widening float casts;
    * every other cast (to ``bool``, to or from a complex dtype, from ``bool`` for a sum, integer and
      float mixed for a sum, narrowing floats for a sum) reduces first.
    """
    if src == dst:
        return True
    if dst == torch.bool or src.is_complex or dst.is_complex:
        return False
    both_integer, both_float = is_integer(src) and is_integer(dst), src.is_floating_point and dst.is_floating_point
    if reduce_op in ("max", "min"):
        if both_integer:
            return _holds(dst, src)
        return not (src.is_floating_point and is_integer(dst))
    if reduce_op == "sum" and both_integer:
        return dst.itemsize <= src.itemsize
    return reduce_op in ("sum", "avg") and both_float and _holds(dst, src)

"""qstate's random streams, specified once: keys, the position hash, draws and flat indices.

Every path (eager, compiled, C, DTensor) calls these functions or follows them bit for bit:

* **splitmix64** (Steele, Lea and Flood, 2014): the state advances by :data:`GAMMA` (mod
  ``2**64``) per output; output ``i`` (from 0) of the stream seeded with ``key`` is
  ``mix(key + (i + 1) * GAMMA)`` (:func:`mix`).
* **Keys.** One update draws :func:`param_key` (63 bits of the CPU's default generator, which an
  optimizer step seeds from its own stream) when its first stochastically rounded write asks;
  the parameter at position ``i`` of the update's list takes ``mix(base + i + GAMMA)``
  (:class:`ParamKeys`), and its state ``j`` (in the rule's state order) ``state_key(key, j) = key
  ^ (j + 1) * GAMMA`` (mod ``2**64``).
* **The position hash.** The element at flat index ``n`` of the full tensor hashes to
  ``lowbias32(n_lo ^ k_lo ^ lowbias32(n_hi ^ k_hi))`` over the 32-bit halves of ``n`` and the
  key (:func:`position_hash32`; ``lowbias32`` is Chris Wellons' 32-bit mix, :func:`lowbias32_int`).
  A state's stochastic rounding takes the whole 32-bit hash, a bfloat16 parameter's its top 16
  bits (:func:`position_draws`).
* **Flat indices**: each element's row-major index in the full tensor (:func:`flat_index`,
  ``qstate::flat_index_like``, which DTensor computes shard by shard): a shard draws what the whole
  tensor would draw at its elements, so sharding, the world size and the path never change a draw.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from ._library import LIBRARY, flat_index_like

__all__ = ["GAMMA", "MIX1", "MIX2", "MASK64", "mix", "as_int64", "param_key", "ParamKeys", "STATE_KEY_STEP",
           "state_key", "lowbias32", "lowbias32_int", "position_hash32", "position_draws", "flat_index",
           "key_draws"]

# ------------------------------------------------------------------ splitmix64
#: the state's increment per output (the golden ratio's 64-bit fraction, odd)
GAMMA = 0x9E3779B97F4A7C15
#: the output function's two multipliers
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def mix(z: int) -> int:
    """The output of state ``z`` (taken mod 2**64): a bijection of 64-bit words, in [0, 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def as_int64(u: int) -> int:
    """The 64-bit word ``u`` (in [0, 2**64)) as a two's-complement int64 value, for tensors."""
    return u - (1 << 64) if u >= 1 << 63 else u


# ------------------------------------------------------------------------ keys
def param_key() -> int:
    """63 random bits from the CPU's default generator (in an optimizer step: its rounding stream, which
    ``PolicyOptimizer.step`` seeds from the seed, group and step)."""
    with _disable_current_modes():  # host data: drawn on the host, never by a mode (LocalTensorMode's per rank)
        return int(torch.empty((), dtype=torch.int64).random_())


class ParamKeys:
    """The stochastic-rounding keys of one call of the update: ``keys(i)`` for the parameter at position ``i``
    of the call's list, splitmix64 of ``base + i``, where ``base`` is one :func:`param_key` drawn when the
    first key is asked for (so a call without stochastic rounding draws nothing)."""

    __slots__ = ("base",)

    def __init__(self):
        self.base: Optional[int] = None

    def __call__(self, i: int) -> int:
        if self.base is None:
            self.base = param_key()
        return mix(self.base + i + GAMMA)


#: the per-state step of :func:`state_key` (splitmix64's increment)
STATE_KEY_STEP = GAMMA


def state_key(key: int, index: int) -> int:
    """The draw key of the update's state ``index`` (0-based, in the rule's state order) under the
    parameter's 64-bit ``key`` (an int; the result in ``[0, 2**64)``)."""
    return (key ^ ((index + 1) * STATE_KEY_STEP)) & MASK64


# ------------------------------------------------------------- position hash
#: the low 32 bits: lowbias32 runs on 32-bit words held in int64
MASK32 = 0xFFFFFFFF
#: ``0x846ca68b - 2**32``: the same product mod ``2**32``, and ``|x * k| < 2**63`` for ``x < 2**32``
_K2_SIGNED = 0x846CA68B - (1 << 32)


def lowbias32(y: Tensor) -> Tensor:
    """``lowbias32(bits(y))`` for float32 ``y``, as int64 values in ``[0, 2**32)``."""
    return lowbias32_int(y.view(torch.int32).long() & MASK32)


def lowbias32_int(x: Tensor) -> Tensor:
    """``lowbias32(x)`` of int64 ``x`` in ``[0, 2**32)``, as int64 values in ``[0, 2**32)``:
    ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16`` mod ``2**32``.

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


def position_hash32(key: Union[Tensor, int], index: Tensor) -> Tensor:
    """32-bit hashes (int64 in ``[0, 2**32)``) of the flat indices ``index`` (int64, >= 0) under the
    64-bit ``key`` (an int64 tensor, or an int: taken mod ``2**64``): ``lowbias32(n_lo ^ k_lo ^
    lowbias32(n_hi ^ k_hi))`` of the 32-bit halves (the C kernel's ``position_hash``). For one key and
    ``n_hi`` it is a bijection of ``n_lo``: the elements of one tensor get distinct hashes; the inner hash
    is one value per ``2**32`` elements, so a kernel hashes each element once."""
    if not isinstance(key, Tensor):
        key &= MASK64
        k_lo, k_hi = key & MASK32, key >> 32
    else:
        k_lo, k_hi = key & MASK32, torch.bitwise_right_shift(key, 32) & MASK32
    high = lowbias32_int((torch.bitwise_right_shift(index, 32) & MASK32) ^ k_hi)
    return lowbias32_int((index & MASK32) ^ k_lo ^ high)


def position_draws(key: Union[Tensor, int], index: Tensor) -> Tensor:
    """16-bit draws (int64 in ``[0, 2**16)``) of the elements at the flat indices ``index`` (int64, >= 0)
    under the 64-bit ``key`` (an int64 tensor or int: the key's two's complement): the top 16 bits of
    :func:`position_hash32` (the C kernel's ``param_draw``)."""
    return torch.bitwise_right_shift(position_hash32(key, index), 16)


# --------------------------------------------------------------- flat indices
def flat_index(p: Tensor, start: int = 0) -> Tensor:
    """Each element's flat index in the full tensor, in ``p``'s shape (a plain tensor or a DTensor of any
    layout: ``qstate::flat_index_like``). ``start``: the flat index of a plain ``p``'s first element in the
    full tensor it is one range of (a shard's, as the fused kernels take it)."""
    index = flat_index_like(p)
    return index + start if start else index


def key_draws(key: int, p: Tensor, start: int = 0) -> Tensor:
    """:func:`position_draws` of ``p``'s elements by their :func:`flat_index` under the 64-bit ``key`` (a
    Python int in ``[0, 2**64)``), in ``p``'s shape."""
    return position_draws(as_int64(key), flat_index(p, start))


def _flat_index(self: Tensor) -> Tensor:
    """``qstate::flat_index_like``'s kernel: a plain tensor's elements' row-major indices."""
    return torch.arange(self.numel(), dtype=torch.int64, device=self.device).view(self.shape)


LIBRARY.impl("flat_index_like", _flat_index, "CompositeExplicitAutograd")

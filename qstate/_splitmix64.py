"""splitmix64 (Steele, Lea and Flood, 2014): the constants and the output function of qstate's
counter-based random streams, shared by the DTensor rules' positional stream
(:func:`qstate.dtensor_rules._random_ops.mix64`, the same steps on int64 tensors) and the C kernel's
per-parameter stochastic-rounding keys (:class:`qstate.optim._cpu_kernel.ParamKeys`).

The generator's state advances by :data:`GAMMA` (mod 2**64) per output; output ``i`` (from 0) of the stream
seeded with ``key`` is ``mix(key + (i + 1) * GAMMA)``.
"""

from __future__ import annotations

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

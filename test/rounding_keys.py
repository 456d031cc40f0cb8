"""The stochastic-rounding keys of qstate's updates, written out from their specification: the
references the tests compare the kernels' and the DTensor rules' draws with (no dependency beyond
torch, so the device checks can import it)."""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


def splitmix64(key: int, i: int) -> int:
    """Output ``i`` (from 0) of the splitmix64 stream seeded with ``key`` (Steele, Lea and Flood, 2014),
    written out: the reference for qstate's counter-based streams (the DTensor rules' positional stream,
    the parameters' stochastic-rounding keys)."""
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def param_keys(count: int) -> list[int]:
    """The stochastic-rounding keys of the parameters at positions ``0 .. count - 1`` of one call of the
    update, drawn as the update draws them from the default CPU generator: one 63-bit ``base`` (one
    ``random_()`` of an int64 scalar), then ``splitmix64(base + position, 0)`` per parameter. Call it
    where the update would draw (after the same ``torch.manual_seed``)."""
    base = int(torch.empty((), dtype=torch.int64).random_())
    return [splitmix64(base + position, 0) for position in range(count)]

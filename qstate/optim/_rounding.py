"""Writing float32 results into a parameter: round to nearest, or stochastically to bfloat16.

Stochastic rounding uses plain tensor ops on the value's bit pattern (no
local-tensor access), so it runs unchanged on plain tensors, inside compiled
kernels and on DTensors (given sharding rules for ``view(dtype)`` and
``randint_like``):

``bits = x.view(int32)``; the low 16 bits are the part bfloat16 drops; with
``r`` uniform in ``[0, 2**16)``, round the magnitude up (``(bits & -65536) +
0x10000``) when ``r < bits & 0xFFFF``, else truncate (``bits & -65536``).
The result rounds up with probability ``low / 2**16``, so its expected value
is exactly ``x`` (float32 sign-magnitude bits make this hold for negative
values too). Random bits come from the default generator of ``x``'s device;
the optimizer swaps its own saved generator state in around the step.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["stochastic_round_bf16", "store_param"]


def stochastic_round_bf16(x: Tensor) -> Tensor:
    """``x`` (float32) rounded stochastically to bfloat16, unbiased."""
    bits = x.view(torch.int32)
    r = torch.randint_like(bits, 0, 1 << 16)
    truncated = bits & -65536
    rounded = torch.where(r < (bits & 0xFFFF), truncated + 0x10000, truncated)
    return rounded.view(torch.float32).bfloat16()


def store_param(p: Tensor, value: Tensor, stochastic_round: bool) -> None:
    """``p.copy_(value)``; a bfloat16 ``p`` with ``stochastic_round`` rounds stochastically."""
    if stochastic_round and p.dtype == torch.bfloat16:
        value = stochastic_round_bf16(value.float())
    p.copy_(value)

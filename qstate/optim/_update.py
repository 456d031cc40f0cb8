"""The eager update of one parameter: the rule's math op by op (DTensors included)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ._rounding import key_draws, store_param
from ._rules import UpdateRule

__all__ = ["update_eagerly"]


def update_eagerly(rule: UpdateRule, flags: dict, p: Tensor, g: Tensor, states: Sequence[Tensor], h: dict,
                   stochastic_round: bool, key: Optional[int] = None, start: int = 0) -> None:
    """Update ``p`` and ``states`` in place with out-of-place math, then ``copy_`` back.

    States are read with out-of-place math (quantized ones give plain float32
    values, a plain low-precision state is read as float32) and written with
    ``state.copy_(new)``, which requantizes a quantized state in its own layout.
    A bfloat16 ``p`` rounding stochastically draws by place under ``key``
    (the fused kernels' draws, :func:`~._rounding.key_draws`; plain tensors
    and DTensors alike; ``start``: a shard's first flat index in the full
    tensor), or without one from the default generator.
    """
    p32 = p if p.dtype == torch.float32 else p.float()
    g32 = g if g.dtype == torch.float32 else g.float()
    readable = [x if x.dtype == torch.float32 else x.float() for x in states]
    p_new, new = rule.math(p32, g32, readable, h, flags)
    for x, value in zip(states, new):
        x.copy_(value)
    sr = stochastic_round and p.dtype == torch.bfloat16
    store_param(p, p_new, sr, key_draws(key, p, start) if sr and key is not None else None)

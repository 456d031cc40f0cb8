"""The eager update of one parameter: the rule's math op by op (DTensors included)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..._dtensor import rounds_stochastically
from ..._library import copy_with_draws_
from ..._random import flat_index, key_draws, position_hash32, state_key
from .param_rounding import store_param
from ..rules import UpdateRule

__all__ = ["update_eagerly", "write_states"]


def update_eagerly(rule: UpdateRule, flags: dict, p: Tensor, g: Tensor, states: Sequence[Tensor], h: dict,
                   stochastic_round: bool, key: Optional[int] = None, start: int = 0) -> None:
    """Update ``p`` and ``states`` in place with out-of-place math, then ``copy_`` back.

    States are read with out-of-place math (quantized ones give plain float32
    values, a plain low-precision state is read as float32) and written with
    ``state.copy_(new)``, which requantizes a quantized state in its own layout.
    Under a ``key``, draws are by place, as the fused kernels draw (each
    element's index in the full tensor, ``qstate::flat_index_like`` on plain
    tensors and DTensors alike; ``start``: a shard's first flat index in the
    full tensor): a state that rounds stochastically is written with
    ``qstate::copy_with_draws_`` (state ``i`` under ``state_key(key, i)``), and a
    bfloat16 ``p`` rounding stochastically with :func:`qstate._random.key_draws`;
    without a key, ``p`` draws from the default generator and states by value.
    """
    p32 = p if p.dtype == torch.float32 else p.float()
    g32 = g if g.dtype == torch.float32 else g.float()
    readable = [x if x.dtype == torch.float32 else x.float() for x in states]
    p_new, new = rule.math(p32, g32, readable, h, flags)
    write_states(p, states, new, key, start)
    sr = stochastic_round and p.dtype == torch.bfloat16
    store_param(p, p_new, sr, key_draws(key, p, start) if sr and key is not None else None)


def write_states(p: Tensor, states: Sequence[Tensor], values: Sequence[Tensor], key: Optional[int] = None,
                 start: int = 0) -> None:
    """``states[i].copy_(values[i])`` for the states of parameter ``p`` (their shape and layout); under a
    ``key`` (64 bits), a state that rounds stochastically draws by place, as the fused kernels draw:
    ``qstate::copy_with_draws_`` with :func:`qstate.formats.position_hash32` of ``state_key(key, i)`` and
    each element's flat index in the full tensor (``start``: a plain shard's first)."""
    index = None
    for i, (x, value) in enumerate(zip(states, values)):
        if key is None or not rounds_stochastically(x):
            x.copy_(value)
            continue
        if index is None:
            index = flat_index(p, start)
        copy_with_draws_(x, value, position_hash32(state_key(key, i), index))

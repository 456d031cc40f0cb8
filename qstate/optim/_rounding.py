"""Writing float32 results into a parameter: round to nearest, or stochastically to bfloat16.

Stochastic rounding uses plain tensor ops on the value's bit pattern (no
local-tensor access), so it runs unchanged on plain tensors and inside
compiled kernels; on DTensors it runs as qstate's own ops, which DTensor
runs shard by shard under qstate's rules (``qstate::stochastic_round_bf16``,
``qstate::flat_index_like``), and otherwise only ops whose torch rules are
right for any layout (``&``, ``^``, ``torch.bitwise_right_shift``):

``bits = x.view(int32)``; the low 16 bits are the part bfloat16 drops; with
``r`` uniform in ``[0, 2**16)``, round the magnitude up (``(bits & -65536) +
0x10000``) when ``r < bits & 0xFFFF``, else truncate (``bits & -65536``).
The result rounds up with probability ``low / 2**16``, so its expected value
is exactly ``x`` (float32 sign-magnitude bits make this hold for negative
values too).

Where ``r`` comes from: every path of the optimizers (the CPU C kernel, the
compiled inductor kernel, the eager math on plain tensors and on DTensors of
any layout) draws it from a hash of a 64-bit key (one per parameter and
update) and each element's flat index in the full parameter
(:func:`position_draws`, the C kernel's ``param_draw``; :func:`key_draws`),
so all give the same bits for the same float32 value, and shards of a
parameter draw as the whole parameter would. The optimizer swaps its own
saved generator state in around the step and draws the keys from it.
:func:`stochastic_round_bf16` without draws takes ``randint_like`` of the
default generator of ``x``'s device (on a DTensor the positional
:func:`qstate.dtensor_rules.positional_randint_like`: independent shards).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .._library import LIBRARY, flat_index_like
from .._library import stochastic_round_bf16 as stochastic_round_bf16_op
from .._dtensor import dtensor_type
from .._splitmix64 import as_int64
from ..formats import position_hash32

__all__ = ["flat_index", "key_draws", "position_draws", "stochastic_round_bf16", "store_param"]

_DTensor = dtensor_type()  # None in a torch built without distributed


def stochastic_round_bf16(x: Tensor, draws: Optional[Tensor] = None) -> Tensor:
    """``x`` (float32) rounded stochastically to bfloat16, unbiased: with ``draws`` (integers in
    ``[0, 2**16)`` of ``x``'s shape, e.g. :func:`position_draws`), else from the default generator.

    A DTensor ``x`` runs ``qstate::stochastic_round_bf16`` (shard by shard, ``draws`` laid out like
    ``x``); without draws it takes :func:`qstate.dtensor_rules.positional_randint_like`'s, one key
    from the default generator hashed with each element's global index."""
    if _DTensor is not None and isinstance(x, _DTensor):
        if draws is None:
            from ..dtensor_rules import positional_randint_like

            draws = positional_randint_like(x, 0, 1 << 16, dtype=torch.int32)
        return stochastic_round_bf16_op(x, draws)
    if draws is None:
        draws = torch.randint_like(x.view(torch.int32), 0, 1 << 16)
    return _stochastic_round_bf16(x, draws)


def _stochastic_round_bf16(x: Tensor, draws: Tensor) -> Tensor:
    """``qstate::stochastic_round_bf16``'s kernel (plain tensors)."""
    bits = x.view(torch.int32)
    truncated = bits & -65536
    rounded = torch.where(draws < (bits & 0xFFFF), truncated + 0x10000, truncated)
    return rounded.view(torch.float32).bfloat16()


LIBRARY.impl("stochastic_round_bf16", _stochastic_round_bf16, "CompositeExplicitAutograd")


def position_draws(key: Union[Tensor, int], index: Tensor) -> Tensor:
    """16-bit draws (int64 in ``[0, 2**16)``) of the elements at the flat indices ``index`` (int64, >= 0)
    under the 64-bit ``key`` (an int64 tensor or int: the key's two's complement): the top 16 bits of
    :func:`qstate.formats.position_hash32` (the C kernel's ``param_draw``)."""
    return _shr(position_hash32(key, index), 16)


def _shr(x: Union[Tensor, int], s: int) -> Union[Tensor, int]:
    """``x >> s`` (arithmetic); for tensors ``torch.bitwise_right_shift``, which DTensor runs shard by
    shard (its ``x >> s``, ``aten.__rshift__``, returns ``x``: torch 2.13, 2.14)."""
    return torch.bitwise_right_shift(x, s) if isinstance(x, Tensor) else x >> s


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


def store_param(p: Tensor, value: Tensor, stochastic_round: bool, draws: Optional[Tensor] = None) -> None:
    """``p.copy_(value)``; a bfloat16 ``p`` with ``stochastic_round`` rounds stochastically (with ``draws``
    where given: :func:`stochastic_round_bf16`)."""
    if stochastic_round and p.dtype == torch.bfloat16:
        value = stochastic_round_bf16(value.float(), draws)
    p.copy_(value)

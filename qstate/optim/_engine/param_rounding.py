"""Writing float32 results into a parameter: round to nearest, or stochastically to bfloat16.

The stochastic rule works on the value's bits: ``bits = x.view(int32)``; with ``r`` uniform in
``[0, 2**16)``, round the magnitude up (``(bits & -65536) + 0x10000``) when ``r < bits & 0xFFFF``,
else truncate. The result rounds up with probability ``low / 2**16``: its expected value is exactly
``x`` (sign-magnitude bits make this hold for negative values). Plain tensor ops only, so it runs
in compiled kernels and, as ``qstate::stochastic_round_bf16``, on DTensors shard by shard.

Every path of the optimizers draws ``r`` from a hash of one 64-bit key per parameter and update
and each element's flat index in the full parameter (:func:`qstate._random.position_draws`), so
all paths give the same bits and shards draw as the whole parameter would.
:func:`stochastic_round_bf16` without draws takes ``randint_like`` of the default generator (on a
DTensor the positional :func:`qstate.dtensor_rules.positional_randint_like`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._library import LIBRARY
from ..._library import stochastic_round_bf16 as stochastic_round_bf16_op
from ..._dtensor import dtensor_type

__all__ = ["stochastic_round_bf16", "store_param"]

_DTensor = dtensor_type()  # None in a torch built without distributed


def stochastic_round_bf16(x: Tensor, draws: Optional[Tensor] = None) -> Tensor:
    """``x`` (float32) rounded stochastically to bfloat16, unbiased: with ``draws`` (integers in
    ``[0, 2**16)`` of ``x``'s shape, e.g. :func:`qstate._random.position_draws`), else from the default generator.

    A DTensor ``x`` runs ``qstate::stochastic_round_bf16`` (shard by shard, ``draws`` laid out like
    ``x``); without draws it takes :func:`qstate.dtensor_rules.positional_randint_like`'s, one key
    from the default generator hashed with each element's global index."""
    if _DTensor is not None and isinstance(x, _DTensor):
        if draws is None:
            from ...dtensor_rules import positional_randint_like

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


def store_param(p: Tensor, value: Tensor, stochastic_round: bool, draws: Optional[Tensor] = None) -> None:
    """``p.copy_(value)``; a bfloat16 ``p`` with ``stochastic_round`` rounds stochastically (with ``draws``
    where given: :func:`stochastic_round_bf16`)."""
    if stochastic_round and p.dtype == torch.bfloat16:
        value = stochastic_round_bf16(value.float(), draws)
    p.copy_(value)

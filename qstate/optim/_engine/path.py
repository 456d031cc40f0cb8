"""How a parameter's update runs: the engine's path, chosen here and nowhere else.

:func:`group_path` maps a param group's torch.optim ``fused``/``foreach`` to the path it asks for;
:func:`choose_path` decides per parameter, in the step, the same on every rank (a DTensor's
sizes are global): the rule's math op by op outside the op, or the op ``qstate::fused_update``
with its eager variant (the math op by op inside one call) or its fused variant. Inside the
op, :func:`choose_kernel` decides per parameter or DTensor shard: the fused kernel of the
backend :func:`~.backends.backend_for` names (the C kernel, inductor's), or the math op by op
for tensors the fused kernels do not take. A prepared call (:mod:`.prepared`) reruns what
:func:`choose_kernel` chose, while its checks hold.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..._dtensor import is_dtensor, is_quantized_state
from ..._state import QuantizedState
from .backends import GENERATION, FusedBackend, backend_for, default_backend
from .spec import KernelSpec, fusable

__all__ = ["SMALL_PLAIN_NUMEL", "Path", "ShardKernel", "group_path", "choose_path", "choose_kernel"]


class Path(enum.Enum):
    """Where a parameter's update runs (:func:`choose_path`)."""

    OP_BY_OP = "the rule's math op by op, outside the op"
    EAGER = "the op with its eager variant: the rule's math op by op inside one call"
    FUSED = "the op with its fused variant: a fused kernel per parameter or shard"


#: plain-state parameters below this size take :attr:`Path.EAGER` where only the default backend (a
#: compiled kernel, whose call costs more than the math op by op at this size) would take them
SMALL_PLAIN_NUMEL = 65536

_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def group_path(group: dict, compile: bool) -> Path:
    """The path a param group's ``fused``/``foreach`` ask for, as they choose torch.optim's, in an optimizer
    with ``compile`` (the table of :mod:`qstate.optim._arguments`): ``foreach=True`` the eager variant,
    ``fused=False`` or ``compile=False`` op by op, anything else the fused variant. :func:`choose_path`
    then decides each parameter's."""
    if group.get("foreach") is True:
        return Path.EAGER
    if group.get("fused") is False or not compile:
        return Path.OP_BY_OP
    return Path.FUSED


def choose_path(rule: str, flags: tuple, p: Tensor, g: Tensor, states: Sequence[Tensor], stochastic_round: bool,
                *, compile: bool, foreach: bool) -> Path:
    """The path of ``p``'s update (``flags``: the rule's sorted static flags; ``stochastic_round``: the
    bf16 parameter rounds stochastically), as torch.optim's ``fused``/``foreach``/for-loop choice."""
    if not (compile or foreach):
        return Path.OP_BY_OP  # torch.optim's for-loop
    if is_dtensor(p):
        if not (is_dtensor(g) and all(is_dtensor(s) for s in states)):
            return Path.OP_BY_OP  # DTensor's strategy for the op takes DTensors only
    elif not (type(p) in _PLAIN_TYPES and type(g) is Tensor
              and all(type(s) is Tensor or type(s) is QuantizedState for s in states)):
        return Path.OP_BY_OP  # tensor subclasses the op's kernels do not take
    if foreach:
        return Path.EAGER  # torch.optim's foreach: the math op by op, one call over the list
    if _small_and_plain(p, states) and _default_backend_only(rule, flags, p, g, states, stochastic_round):
        return Path.EAGER  # small plain states: a compiled kernel's call costs more than the math
    return Path.FUSED


class ShardKernel(NamedTuple):
    """What runs one parameter's (or shard's) update inside the op: ``backend``'s fused kernel of
    ``spec``, or, where ``backend`` is None, the rule's math op by op."""

    spec: Optional[KernelSpec]
    backend: Optional[FusedBackend]


_OP_BY_OP = ShardKernel(None, None)


def choose_kernel(rule: str, flags: tuple, stochastic_round: bool, eager: bool, p: Tensor, g: Tensor,
                  states: Sequence[Tensor]) -> ShardKernel:
    """The op's kernel for ``p`` (a plain tensor: a parameter or a DTensor's shard) of a call of the
    eager (``eager``) or fused variant."""
    if eager or not fusable(p, g, states):
        return _OP_BY_OP  # the eager variant, or views, mixed devices, maps not the format's
    spec = KernelSpec.of(rule, flags, p, states, stochastic_round)
    return ShardKernel(spec, backend_for(spec, p.device.type, g.dtype))


def _small_and_plain(p: Tensor, states: Sequence[Tensor]) -> bool:
    # numel() of a DTensor is global: the same choice on every rank and world size
    return p.numel() < SMALL_PLAIN_NUMEL and not any(is_quantized_state(s) for s in states)


def _default_backend_only(rule: str, flags: tuple, p: Tensor, g: Tensor, states: Sequence[Tensor],
                          stochastic_round: bool) -> bool:
    """Whether only the default backend would take ``p``'s kernel spec (memoized per dtypes: asked every
    step for every small parameter)."""
    key = (rule, flags, p.dtype, g.dtype, stochastic_round, tuple(s.dtype for s in states), p.device.type,
           GENERATION[0])
    verdict = _DEFAULT_ONLY.get(key)
    if verdict is None:
        spec = KernelSpec.of(rule, flags, p, states, stochastic_round)
        verdict = _DEFAULT_ONLY[key] = backend_for(spec, p.device.type, g.dtype) is default_backend()
    return verdict


_DEFAULT_ONLY: dict[tuple, bool] = {}

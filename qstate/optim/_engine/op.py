"""Kernels of ``qstate::fused_update`` (schema: :mod:`qstate._library`): the update as an operator
DTensor dispatches as data, as torch's ``_fused_adamw_``.

One kernel serves every device (``CompositeExplicitAutograd``; meta/fake: shapes only), and the
op's rule for :class:`~qstate.QuantizedState` states (``register_torch_dispatch``) calls the same
kernel with the states as they are. For each parameter (or DTensor shard) it runs the prepared
call of an earlier step where one is valid (:mod:`.prepared`), else what
:func:`.path.choose_kernel` chooses: a backend's fused kernel or the rule's math op by op.

``variant`` is a JSON object naming the registered rule, its static flags, the bf16 parameters'
stochastic rounding and whether the call runs the math op by op (``eager``), with
``tensor_scalars``: the scalars given as tensors (:class:`UpdateVariant`; the op parses it, no
registry). ``hyper`` holds the rule's scalars in ``scalar_names`` order, float64: the fused kernels
compute with it rounded to float32, the eager variant with the floats themselves.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary
from torch import Tensor

from ... import _random
from ..._library import LIBRARY, fused_update, states_per_param
from ..._state import QuantizedState
from ..rules import RULES, UpdateRule
from .eager import update_eagerly
from .path import choose_kernel
from .prepared import PreparedUpdate, registered_call

__all__ = ["UpdateVariant", "PendingCalls", "fused_update", "update"]

#: the types a static flag's value may have (it travels in ``variant`` as JSON)
_FLAG_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class UpdateVariant:
    """What one call of the op computes besides its tensors and scalars; :attr:`name` is the op's
    ``variant`` argument and :meth:`parse` its inverse."""

    rule: str
    flags: tuple  # sorted (name, value) pairs; values bool, int, float or str
    stochastic_round: bool
    #: run the rule's math op by op on each shard with the floats of ``hyper`` (and the names in
    #: ``tensor_scalars`` as float32 tensors), as the eager path computes on a plain tensor
    eager: bool = False
    tensor_scalars: tuple = ()

    @property
    def name(self) -> str:
        return _variant_name(self)

    @staticmethod
    def parse(name: str) -> "UpdateVariant":
        """The variant ``name`` names; raises ``ValueError`` naming the op and what is wrong."""
        return _parse_variant(name)

    @property
    def rule_key(self) -> tuple:
        """``(rule, flags, stochastic_round)``, which a prepared call is checked against
        (:meth:`~.prepared.PreparedUpdate.valid`)."""
        return (self.rule, self.flags, self.stochastic_round)


@functools.lru_cache(maxsize=None)
def _variant_name(variant: UpdateVariant) -> str:
    for flag, value in variant.flags:
        if not isinstance(value, _FLAG_TYPES):
            raise TypeError(f"qstate::fused_update: the update rule {variant.rule!r}'s static flag {flag!r} must be "
                            f"a bool, int, float or str, got {type(value).__name__}")
    return json.dumps({"rule": variant.rule, "flags": dict(variant.flags), "stochastic_round": variant.stochastic_round,
                       "eager": variant.eager, "tensor_scalars": list(variant.tensor_scalars)},
                      sort_keys=True, separators=(",", ":"))


_VARIANT_KEYS = {"rule", "flags", "stochastic_round", "eager", "tensor_scalars"}


@functools.lru_cache(maxsize=None)
def _parse_variant(name: str) -> UpdateVariant:
    try:
        fields = json.loads(name)
    except ValueError:
        fields = None
    if not isinstance(fields, dict) or set(fields) != _VARIANT_KEYS or not isinstance(fields["flags"], dict):
        raise ValueError(f"qstate::fused_update: expected variant to be a JSON object with the keys "
                         f"{sorted(_VARIANT_KEYS)} (UpdateVariant.name), got {name!r}")
    if fields["rule"] not in RULES:
        raise ValueError(f"qstate::fused_update: variant names the update rule {fields['rule']!r}, which is not "
                         f"registered (qstate.optim.register_rule)")
    return UpdateVariant(fields["rule"], tuple(sorted(fields["flags"].items())), bool(fields["stochastic_round"]),
                         bool(fields["eager"]), tuple(fields["tensor_scalars"]))


def update(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Tensor], hyper: Tensor,
           variant: str, sr_keys: Optional[Sequence[int]] = None, starts: Optional[Sequence[Tensor]] = None) -> None:
    """The op's kernel on every device (see :mod:`qstate._library` for the lists' layout, ``sr_keys`` and
    ``starts``): each parameter's prepared call where it has a valid one, else the kernel
    :func:`.path.choose_kernel` chooses.

    With ``sr_keys`` each parameter's draws (a bf16 parameter's with stochastic rounding, its states'
    with stochastic rounding) follow its key and each element's place in the full tensor, in the fused
    kernels and op by op alike; a parameter that rounds nothing stochastically reads no key."""
    n = states_per_param(params, grads, states)
    call = UpdateVariant.parse(variant)
    if sr_keys is not None and (len(sr_keys) != len(params) or starts is None or len(starts) != len(params)):
        raise ValueError(f"qstate::fused_update: expected one sr_key and start per param, got {len(params)} "
                         f"params, {len(sr_keys)} sr_keys, {'no' if starts is None else len(starts)} starts")
    rule = RULES[call.rule]
    if hyper.dim() != 1 or hyper.numel() != len(rule.scalar_names) or not hyper.is_floating_point():
        # the kernels read one scalar per name: a shorter vector would be read past its end
        raise ValueError(f"qstate::fused_update: expected hyper to be a floating-point vector of the "
                         f"{len(rule.scalar_names)} scalars of {call.rule!r} ({', '.join(rule.scalar_names)}), "
                         f"got shape {tuple(hyper.shape)}, dtype {hyper.dtype}")
    if call.eager:
        h = _eager_scalars(rule, call, hyper, params[0].device) if params else {}
    else:
        hyper = hyper.to(torch.float32)  # the fused kernels' scalars
        h = None
    pending = PendingCalls(hyper)  # shards whose fused-kernel call is prepared: one group per kernel
    for i, (param, grad) in enumerate(zip(params, grads)):
        shard_states = list(states[i * n:(i + 1) * n])
        key = None if sr_keys is None else sr_keys[i] & _random.MASK64  # the C kernel's uint64
        start = 0 if sr_keys is None else _start_value(starts[i])
        found = None if call.eager else registered_call(param, shard_states)
        if found is not None and found.valid(call.rule_key, param, grad, shard_states, start):
            pending.add(found, param, grad, (_random.param_key() if key is None else key) if found.sr else 0)
            continue
        pending.before(param)
        kernel = choose_kernel(call.rule, call.flags, call.stochastic_round, call.eager, param, grad, shard_states)
        if kernel.backend is not None:
            kernel.backend.run(kernel.spec, param, grad, shard_states, hyper, key, start)
            continue
        # op by op, a key draws as the fused kernels do: by each element's place in the full tensor
        scalars = h if h is not None else {name: hyper[j] for j, name in enumerate(rule.scalar_names)}
        update_eagerly(rule, dict(call.flags), param, grad, shard_states, scalars, call.stochastic_round, key, start)
    pending.run()


def _eager_scalars(rule: UpdateRule, call: UpdateVariant, hyper: Tensor, device: torch.device) -> dict:
    """The eager variant's scalars: the floats of ``hyper``, the names in ``tensor_scalars`` as float32
    tensors on ``device`` (as the eager path has them)."""
    h = dict(zip(rule.scalar_names, hyper.tolist()))
    for name in call.tensor_scalars:
        h[name] = torch.tensor(h[name], dtype=torch.float32, device=device)
    return h


class PendingCalls:
    """The valid prepared calls of one op call, queued and run together per call group
    (:meth:`~.prepared.PreparedUpdate.run_group`) with the call's scalars ``hyper``; a parameter
    queued twice runs twice, in order."""

    def __init__(self, hyper: Tensor):
        self.hyper = hyper
        self.groups: dict[tuple, tuple[type, list, list, list, list]] = {}
        self.params: set[int] = set()

    def before(self, p: Tensor) -> None:
        """Run the queue if it updates ``p``: an update of ``p`` outside it comes next."""
        if id(p) in self.params:
            self.run()

    def add(self, call: PreparedUpdate, p: Tensor, g: Tensor, key: int = 0) -> None:
        """Queue ``call`` of ``p`` with ``g`` and, for a stochastically rounding call, its ``key``
        (:class:`qstate._random.ParamKeys`)."""
        self.before(p)
        self.params.add(id(p))
        _, calls, ps, gs, keys = self.groups.setdefault(call.group, (type(call), [], [], [], []))
        calls.append(call)
        ps.append(p)
        gs.append(g)
        keys.append(key)

    def run(self) -> None:
        for cls, calls, ps, gs, keys in self.groups.values():
            cls.run_group(calls, ps, gs, self.hyper, keys)
        self.groups.clear()
        self.params.clear()


#: ``starts`` element -> its value: a shard's start is read once (no device sync per step)
_START_VALUES = WeakIdKeyDictionary()


def _start_value(start: Tensor) -> int:
    value = _START_VALUES.get(start)
    if value is None:
        if start.numel() != 1 or start.dtype != torch.int64:
            raise ValueError(f"qstate::fused_update: expected each start to be one int64 element, got shape "
                             f"{tuple(start.shape)}, dtype {start.dtype}")
        value = _START_VALUES[start] = int(start.item())
    return value


LIBRARY.impl("fused_update", update, "CompositeExplicitAutograd")


# QuantizedState states: the op's rule for the subclass (``torch.library.register_torch_dispatch``: the
# dispatcher runs it where it would run ``QuantizedState.__torch_dispatch__``). The kernels read and write
# the states' codes and scales themselves, so the rule calls the kernel with the states as they are (below
# the Python key the dispatcher would pick the same; redispatching there would leave Python dispatch off
# inside the kernels, which the states' own ops and inductor's tracing need)
def _fused_update_on_states(cls, func, types, args, kwargs):
    update(*args, **kwargs)


torch.library.register_torch_dispatch("qstate::fused_update", QuantizedState, _fused_update_on_states, lib=LIBRARY)

"""Kernels of ``qstate::fused_update``: the fused update as an operator DTensor can dispatch.

``_step.apply_update`` calls the op, one call per (device, variant) per step (with bf16
stochastic rounding where the shards run a fused kernel, with ``sr_keys`` and, on DTensors,
``starts``, see :mod:`qstate._library`). On DTensors, DTensor's sharding strategy for it
(:mod:`qstate.dtensor_rules._fused_ops`) keeps every tensor in its layout (each gradient and
state must share its parameter's, else ``LayoutMismatch`` before any write) and calls the op on
the shards, so the step code never unwraps a DTensor and issues no collectives.

Kernels, as registrations of the op (the dispatcher picks by device):

* ``CPU``: :func:`update_cpu`, the C kernel for the kernel specs it takes, inductor's for the others;
* ``CompositeExplicitAutograd`` (the default: CUDA, any other device): :func:`update_default`,
  inductor's compiled kernel of each kernel spec (:func:`~qstate.optim._kernels.run_compiled`);
* Meta/fake: shapes only (:mod:`qstate._library`);
* :class:`~qstate.QuantizedState` states: the op's rule for the subclass
  (``torch.library.register_torch_dispatch``, which the dispatcher runs in place of its
  ``__torch_dispatch__``) calls the parameters' device's kernel (:data:`KERNELS`), which reads and
  writes the states' codes and scales.

Each runs a parameter's prepared call where it has a valid one (:mod:`._prepared`: the C or
inductor kernel and its arguments from an earlier step, a cache private to the kernels; queued in a
:class:`PendingCalls`, one group per kernel), else its fused kernel when the fused kernels take the tensors
(:func:`~qstate.optim._kernels.fusable`), else the rule's math op by op (:func:`update_eagerly`,
also the reference the kernels' tests compare with); calls built by :func:`eager_variant` (small
plain states) always run the math op by op. ``variant`` is the name of an :class:`UpdateVariant`
registered by :func:`variant_name` (rule, static flags, stochastic rounding, eager).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary
from torch import Tensor

from .. import _random
from .._library import LIBRARY, fused_update, states_per_param
from .._state import QuantizedState
from . import _cpu_kernel
from ._kernels import KernelSpec, fusable, run_compiled
from ._prepared import PreparedUpdate, registered_call
from .rules import RULES, UpdateRule
from ._update import update_eagerly

__all__ = ["UpdateVariant", "PendingCalls", "variant_name", "eager_variant", "fused_variant", "fused_update", "KERNELS", "update_cpu",
           "update_default"]


@dataclass(frozen=True)
class UpdateVariant:
    """What one call of the op computes, besides its tensors and scalars: the registered rule, its static
    flags and bf16 stochastic rounding of the parameters; the op's ``variant`` argument is its name
    (:func:`variant_name`)."""

    rule: str
    flags: tuple  # sorted (name, value) pairs
    stochastic_round: bool
    #: run the rule's math op by op on the shard (small plain states, as for plain tensors); then
    #: ``hyper`` holds the eager scalars in float64 and the names in ``tensor_scalars`` were float32
    #: tensors, so the shard computes exactly what the eager path computes on a plain tensor
    eager: bool = False
    tensor_scalars: tuple = ()

    @property
    def rule_key(self) -> tuple:
        """``(rule, flags, stochastic_round)``, which a prepared call is checked against
        (:meth:`~._prepared.PreparedUpdate.valid`)."""
        return (self.rule, self.flags, self.stochastic_round)


#: name -> variant and variant -> name (the op's ``variant`` argument); one entry per distinct optimizer
#: configuration in the process
_VARIANTS: dict[str, UpdateVariant] = {}
_NAMES: dict[UpdateVariant, str] = {}


def variant_name(variant: UpdateVariant) -> str:
    """The op's ``variant`` argument naming ``variant`` (registered on first use)."""
    name = _NAMES.get(variant)
    if name is None:
        name = _NAMES[variant] = repr(variant)
        _VARIANTS.setdefault(name, variant)
    return name


@functools.cache
def fused_variant(rule: str, flags: tuple, stochastic_round: bool) -> str:
    """The ``variant`` argument of ``torch.ops.qstate.fused_update`` for the registered rule ``rule`` with
    its static ``flags`` (sorted ``(name, value)`` pairs) and bf16 stochastic rounding of the parameters
    on/off; the op's ``hyper`` is then the rule's ``scalar_names`` in order, float32.
    (``variant_name(UpdateVariant(rule, flags, stochastic_round))``, memoized: asked every step.)"""
    return variant_name(UpdateVariant(rule, flags, stochastic_round))


def eager_variant(rule: UpdateRule, flags: tuple, stochastic_round: bool, h: dict) -> tuple[Tensor, UpdateVariant]:
    """``(hyper, variant)`` running the eager math on each shard with the eager scalars ``h``."""
    hyper = torch.tensor([float(h[n]) for n in rule.scalar_names], dtype=torch.float64)
    tensors = tuple(n for n in rule.scalar_names if isinstance(h[n], Tensor))
    return hyper, UpdateVariant(rule.name, flags, stochastic_round, eager=True, tensor_scalars=tensors)


def _eager_scalars(rule: UpdateRule, update: UpdateVariant, hyper: Tensor, device: torch.device) -> dict:
    """The inverse of :func:`eager_variant`: the eager scalars, floats and float32 tensors as given."""
    h = dict(zip(rule.scalar_names, hyper.tolist()))
    for name in update.tensor_scalars:
        h[name] = torch.tensor(h[name], dtype=torch.float32, device=device)
    return h


def update_default(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Tensor], hyper: Tensor,
                   variant: str, sr_keys: Optional[Sequence[int]] = None,
                   starts: Optional[Sequence[Tensor]] = None) -> None:
    """The op's default kernel (``CompositeExplicitAutograd``: CUDA and every device without a kernel of
    its own): inductor's compiled kernel of each fusable parameter's spec, the rule's math op by op for
    the others."""
    _update(run_compiled, params, grads, states, hyper, variant, sr_keys, starts)


def update_cpu(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Tensor], hyper: Tensor,
               variant: str, sr_keys: Optional[Sequence[int]] = None,
               starts: Optional[Sequence[Tensor]] = None) -> None:
    """The op's CPU kernel: the C kernel for the kernel specs it takes (:func:`._cpu_kernel.supports`; the same
    bits as inductor's), inductor's compiled kernel for the other fusable ones, the rule's math op by op
    for the rest."""
    _update(_run_on_cpu, params, grads, states, hyper, variant, sr_keys, starts)


def _run_on_cpu(spec: KernelSpec, p: Tensor, g: Tensor, states: Sequence[Tensor], hyper: Tensor,
                key: Optional[int], start: int) -> None:
    if _cpu_kernel.supports(spec, p.device, g.dtype):
        _cpu_kernel.run(spec, p, g, states, hyper, key, start)
    else:
        run_compiled(spec, p, g, states, hyper, key, start)


def _update(fused_kernel, params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Tensor],
            hyper: Tensor, variant: str, sr_keys: Optional[Sequence[int]], starts: Optional[Sequence[Tensor]]) -> None:
    """Each parameter's update (see :mod:`qstate._library` for the lists' layout, ``sr_keys`` and
    ``starts``): its prepared call where it has a valid one, else ``fused_kernel`` where the fused kernels
    take its tensors, else the rule's math op by op.

    With ``sr_keys`` each parameter's draws (a bf16 parameter's with stochastic rounding, its states'
    with stochastic rounding) follow its key and each element's place in the full tensor, in the fused
    kernels and op by op alike; a parameter that rounds nothing stochastically reads no key."""
    n = states_per_param(params, grads, states)
    update = _VARIANTS[variant]
    if sr_keys is not None and (len(sr_keys) != len(params) or starts is None or len(starts) != len(params)):
        raise ValueError(f"qstate::fused_update: expected one sr_key and start per param, got {len(params)} "
                         f"params, {len(sr_keys)} sr_keys, {'no' if starts is None else len(starts)} starts")
    pending = PendingCalls(hyper)  # shards whose fused-kernel call is prepared: one group per kernel
    for i, (param, grad) in enumerate(zip(params, grads)):
        shard_states = list(states[i * n:(i + 1) * n])
        key = None if sr_keys is None else sr_keys[i] & _random.MASK64  # the C kernel's uint64
        start = 0 if sr_keys is None else _start_value(starts[i])
        found = None if update.eager else registered_call(param, shard_states)
        if found is not None and not found.valid(update.rule_key, param, grad, shard_states, start):
            found = None
        if found is not None:
            sr_key = (_random.param_key() if key is None else key) if found.sr else 0
            pending.add(found, param, grad, sr_key)
        else:
            pending.before(param)
            _update_shard(fused_kernel, param, grad, shard_states, hyper, update, key, start)
    pending.run()


class PendingCalls:
    """The valid prepared calls of one op call, queued and run together per call group
    (:meth:`~._prepared.PreparedUpdate.run_group`) with the call's scalars ``hyper``; a parameter
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


def _update_shard(fused_kernel, param: Tensor, grad: Tensor, states: list[Tensor], hyper: Tensor,
                  update: UpdateVariant, key: Optional[int], start: int) -> None:
    if not update.eager and fusable(param, grad, states):
        spec = KernelSpec.of(update.rule, update.flags, param, states, update.stochastic_round)
        fused_kernel(spec, param, grad, states, hyper, key, start)
        return
    rule = RULES[update.rule]
    if update.eager:
        h = _eager_scalars(rule, update, hyper, param.device)
    else:
        h = {name: hyper[i] for i, name in enumerate(rule.scalar_names)}
    # op by op, a key draws as the fused kernels do: by each element's place in the full tensor
    update_eagerly(rule, dict(update.flags), param, grad, states, h, update.stochastic_round, key, start)


#: the op's kernel per dispatch key: the dispatcher picks for plain tensors
KERNELS = {"CPU": update_cpu, "CompositeExplicitAutograd": update_default}
for _key, _kernel in KERNELS.items():
    LIBRARY.impl("fused_update", _kernel, _key)


# QuantizedState states: the op's rule for the subclass (``torch.library.register_torch_dispatch``: the
# dispatcher runs it where it would run ``QuantizedState.__torch_dispatch__``). The kernels read and write
# the states' codes and scales themselves, so the rule calls the kernel of the parameters' device with
# the states as they are (below the Python key the dispatcher would pick the same; redispatching there
# would leave Python dispatch off inside the kernels, which the states' own ops and inductor's tracing need)
def _fused_update_on_states(cls, func, types, args, kwargs):
    params = args[0]
    on_cpu = bool(params) and params[0].device.type == "cpu"
    (KERNELS["CPU"] if on_cpu else KERNELS["CompositeExplicitAutograd"])(*args, **kwargs)


torch.library.register_torch_dispatch("qstate::fused_update", QuantizedState, _fused_update_on_states, lib=LIBRARY)

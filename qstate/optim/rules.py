"""Update rules: the elementwise math of an optimizer, written once for every execution path.

This module is the contract for rules of your own (qstate's optimizers use it too): an
:class:`UpdateRule` registered with :func:`register_rule` runs in the same fused kernels as
qstate's optimizers (on CPU, C generated from its math), op by op on DTensors, and under
``torch.compile``. A :class:`~qstate.optim.QuantizedOptimizer` subclass naming it as its ``rule``
is a complete optimizer: ``docs/extending.md`` walks through one.

A rule's ``math(p, g, states, h, flags) -> (p_new, new_states)``:

* ``p``/``g`` are float32 values of the parameter and the gradient as the optimizer received it:
  the rule applies the AMP unscale and ``maximize`` itself, with :func:`gradient`;
* ``states`` are the previous states, in :attr:`UpdateRule.states` order, as something readable:
  plain float32 tensors (the fused kernels decode first), or the states themselves (the op-by-op
  path: a plain tensor, a :class:`~qstate.QuantizedState` or a DTensor over one, whose out-of-place
  math returns plain values);
* ``h`` maps every name of :attr:`UpdateRule.scalar_names` to a Python float (op by op: the same
  scalar ops as ``torch.optim``, so fp32 results match it bit for bit) or to a 0-dim float32 tensor
  (the fused kernels: one kernel for every value of lr, betas, step, ...); :func:`add`,
  :func:`addcmul` and :func:`addcdiv` write ``x + alpha * y`` and friends for both;
* ``flags`` are the static flags (:meth:`~qstate.optim.QuantizedOptimizer.rule_flags`), Python values.

It returns the new parameter and the new states (same order, float32, ``p``'s shape). ``math`` uses
out-of-place ops only, never mutates its inputs and never branches on tensor data, so it traces under
``torch.compile(fullgraph=True)`` and runs on DTensors op by op. Each new state is encoded once per
step into its format (round to nearest, or stochastically); states named signed=False must stay
nonnegative.

Each optimizer's file (``adam.py``, ``lion.py``, ...) defines its rule and registers it here;
kernels find a rule by its name in :data:`RULES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

__all__ = ["RULES", "StateSpec", "UpdateRule", "add", "addcdiv", "addcmul", "gradient", "is_tensor", "register_rule"]


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state: its key in ``optimizer.state[p]`` and whether it holds negative values
    (``signed=False``: never negative, such as a second moment; its formats then spend no code on
    signs, and writing a negative value into it raises)."""

    name: str
    signed: bool


@dataclass(frozen=True)
class UpdateRule:
    """An optimizer's elementwise update (module docstring): its states, its per-step scalars and its math.

    ``scalar_names`` starts with ``"lr"`` and ``"grad_unscale"``, which the optimizer fills in (the
    group's ``lr``, and ``1 / grad_scale`` under a ``torch.amp.GradScaler``, else 1.0); ``scalars(group,
    step)`` returns the others for a param group at a step (1 on the first step) as Python floats.
    ``name`` keys :data:`RULES` and the kernel caches: one name per rule."""

    name: str
    #: states given the static flags (e.g. ``max_exp_avg_sq`` only with amsgrad)
    states: Callable[[dict], tuple[StateSpec, ...]]
    #: names of the per-step scalars, in the order of the compiled kernels' ``hyper`` vector;
    #: ``("lr", "grad_unscale", ...)``: those two may be tensors and are filled in by the caller
    scalar_names: tuple[str, ...]
    #: ``scalars(group, step) -> {name: float}`` for the names after ``lr`` and ``grad_unscale``
    scalars: Callable[[dict, int], dict[str, float]]
    math: Callable[..., tuple[Tensor, list[Tensor]]]


def is_tensor(x: Any) -> bool:
    """Whether a scalar of ``h`` is a tensor (the fused kernels) rather than a Python float (op by op)."""
    return isinstance(x, Tensor)


def add(x: Tensor, y: Tensor, alpha: Any) -> Tensor:
    """``x + alpha * y`` (``torch.add(alpha=)`` when ``alpha`` is a number, as torch.optim)."""
    return x + alpha * y if is_tensor(alpha) else x.add(y, alpha=alpha)


def addcmul(x: Tensor, a: Tensor, b: Tensor, value: Any) -> Tensor:
    """``x + value * a * b`` (``torch.addcmul`` when ``value`` is a number, as torch.optim)."""
    return x + a * b * value if is_tensor(value) else x.addcmul(a, b, value=value)


def addcdiv(x: Tensor, a: Tensor, b: Tensor, value: Any) -> Tensor:
    """``x + value * a / b`` (``torch.addcdiv`` when ``value`` is a number, as torch.optim)."""
    return x + value * (a / b) if is_tensor(value) else x.addcdiv(a, b, value=value)


def gradient(g: Tensor, h: dict, flags: dict) -> Tensor:
    """The gradient the rule follows: unscaled by ``grad_unscale`` (AMP), negated if ``maximize``.

    ``grad_unscale`` is ``1 / grad_scale`` of a gradient scaler (``1.0`` without one): the unscale is
    fused into the update, so the scaled gradient is read once and never written.
    """
    inv = h["grad_unscale"]
    if is_tensor(inv) or inv != 1.0:
        g = g * inv
    return -g if flags["maximize"] else g


#: every registered rule by name (``import qstate.optim`` registers qstate's optimizers' rules)
RULES: dict[str, UpdateRule] = {}


def register_rule(rule: UpdateRule) -> UpdateRule:
    """Add ``rule`` to :data:`RULES` (its name must be new) and return it."""
    if rule.name in RULES and RULES[rule.name] is not rule:
        raise ValueError(f"an update rule named {rule.name!r} is already registered")
    RULES[rule.name] = rule
    return rule

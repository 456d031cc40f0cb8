"""Update rules: the elementwise math of an optimizer, written once for every execution path.

An :class:`UpdateRule` names the optimizer's states, its per-step scalars and
its update ``math(p, g, states, h, flags) -> (p_new, new_states)``:

* ``p``/``g`` are float32 values of the parameter and gradient;
* ``states`` are the previous states *as something readable*: plain float32
  tensors (compiled kernels decode first), or the states themselves (eager
  path: a plain tensor, a :class:`~qstate.QuantizedState` or a DTensor over
  one, whose out-of-place math returns plain values);
* ``h`` maps scalar names to Python floats (eager: the same scalar ops as
  ``torch.optim``, so fp32 results match it bit for bit) or to 0-dim float32
  tensors (compiled: one graph for every value of lr, betas, step, ...).

``math`` only uses out-of-place ops, never mutates its inputs, and never
branches on tensor data, so it traces under ``torch.compile(fullgraph=True)``
and runs on DTensors op by op.

Each optimizer's file (``adam.py``, ``lion.py``, ...) defines its rule and registers it here
(:func:`register_rule`); kernels find a rule by its name in :data:`RULES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

__all__ = ["RULES", "StateSpec", "UpdateRule", "add", "addcdiv", "addcmul", "gradient", "is_tensor", "register_rule"]


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state: its ``state`` dict key and whether it holds signed values."""

    name: str
    signed: bool


@dataclass(frozen=True)
class UpdateRule:
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
    return isinstance(x, Tensor)


def add(x: Tensor, y: Tensor, alpha: Any) -> Tensor:
    """``x + alpha * y`` (``torch.add(alpha=)`` when ``alpha`` is a number, as torch.optim)."""
    return x + alpha * y if is_tensor(alpha) else x.add(y, alpha=alpha)


def addcmul(x: Tensor, a: Tensor, b: Tensor, value: Any) -> Tensor:
    return x + a * b * value if is_tensor(value) else x.addcmul(a, b, value=value)


def addcdiv(x: Tensor, a: Tensor, b: Tensor, value: Any) -> Tensor:
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

"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") with a quantized momentum:
the rule's math, the class and the functional form.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

from torch import Tensor

from ._arguments import LR, check_betas, check_implementation, check_lr, check_non_negative
from ._base import QuantizedOptimizer
from .rules import StateSpec, UpdateRule, add, gradient, is_tensor, register_rule
from ._engine import Scalar, apply_update, check_lists

__all__ = ["LION", "Lion", "lion"]


def _lion_states(flags: dict) -> tuple[StateSpec, ...]:
    return (StateSpec("exp_avg", True),)


def _lion_scalars(group: dict, step: int) -> dict[str, float]:
    beta1, beta2 = group["betas"]
    return {"beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"]}


def _lion_math(p: Tensor, g: Tensor, states: Sequence[Tensor], h: dict, flags: dict) -> tuple[Tensor, list[Tensor]]:
    (exp_avg,) = states
    lr, wd = h["lr"], h["weight_decay"]
    g = gradient(g, h, flags)
    if is_tensor(wd) or wd != 0:
        p = p * (1 - lr * wd) if is_tensor(wd) or is_tensor(lr) else p.mul(1 - lr * wd)
    direction = exp_avg.lerp(g, 1 - h["beta1"]).sign()
    p = add(p, direction, -lr)
    return p, [exp_avg.lerp(g, 1 - h["beta2"])]


LION = register_rule(UpdateRule("lion", _lion_states, ("lr", "grad_unscale", "beta1", "beta2", "weight_decay"), _lion_scalars,
                  _lion_math))


class Lion(QuantizedOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") with a quantized momentum;
    the state policy's keywords are :class:`~qstate.optim.StatePolicy`'s."""

    rule = LION

    def __init__(self, params: Iterable, lr: LR = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 **policy: Any):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, **policy)

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        check_lr(name, group["lr"])
        check_betas(name, group["betas"])
        check_non_negative(name, "weight_decay value", group["weight_decay"])
        check_implementation(name, group)

    def rule_flags(self, group: dict) -> dict:
        return {"maximize": bool(group["maximize"])}


def lion(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         state_steps: Optional[Sequence[Union[int, Tensor]]] = None, *, lr: Scalar, beta1: float, beta2: float,
         weight_decay: float, maximize: bool = False, compile: bool = False,
         stochastic_round: bool = False,
        grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """Lion (Chen et al., 2023): ``p -= lr * (sign(lerp(m, g, 1-b1)) + wd * p)``, ``m = lerp(m, g, 1-b2)``."""
    check_lists("lion", params=params, grads=grads, exp_avgs=exp_avgs, state_steps=state_steps)
    steps = state_steps if state_steps is not None else [1] * len(params)
    group = {"betas": (beta1, beta2), "weight_decay": weight_decay}
    apply_update(LION, {"maximize": maximize}, params, grads, [[m] for m in exp_avgs], steps, group,
                 lr=lr, compile=compile, stochastic_round=stochastic_round, grad_scale=grad_scale,
                 found_inf=found_inf)

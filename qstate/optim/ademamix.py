"""AdEMAMix (Pagliardini, Ablin and Grangier, 2024, "The AdEMAMix Optimizer: Better, Faster, Older")
with quantized moments: the rule's math, the class and the functional form.

AdEMAMix is Adam whose numerator mixes a fast EMA of the gradients with a slow one::

    m1 = b1 m1 + (1 - b1) g                 exp_avg_fast (signed; none when b1 == 0: m1 = g)
    m2 = b3 m2 + (1 - b3) g                 exp_avg_slow (signed)
    v  = b2 v  + (1 - b2) g^2               exp_avg_sq   (unsigned)
    p  = p - lr ((m1 / (1 - b1^t) + alpha m2) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay p)

with the paper's optional warmups of ``alpha`` (linear from 0 over ``alpha_warmup`` steps) and of
``b3`` (linear in half-life from ``b1`` over ``beta3_warmup`` steps). Arguments and state names
follow the authors' reference implementation (``apple/ml-ademamix``); the eager math with fp32
states is that implementation's, op for op.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence, Union

from torch import Tensor

from ._arguments import LR, check_implementation, check_lr, check_non_negative
from ._base import QuantizedOptimizer
from .rules import StateSpec, UpdateRule, add, addcmul, gradient, is_tensor, register_rule
from ._engine import Scalar, apply_update, check_lists

__all__ = ["ADEMAMIX", "AdEMAMix", "ademamix", "alpha_at", "beta3_at"]


def alpha_at(step: int, alpha: float, warmup: Optional[int]) -> float:
    """``alpha`` at ``step`` (1-based): linear from 0 over ``warmup`` steps, then ``alpha``."""
    if warmup is not None and step < warmup:
        a = step / float(warmup)
        return a * alpha
    return alpha


def beta3_at(step: int, beta3: float, beta1: float, warmup: Optional[int]) -> float:
    """``beta3`` at ``step`` (1-based): the half-life ``ln(0.5) / ln(beta) - 1`` linear from
    ``beta1``'s to ``beta3``'s over ``warmup`` steps, then ``beta3``."""
    if warmup is not None and step < warmup:
        def half_life(beta: float, eps: float = 1e-8) -> float:
            return math.log(0.5) / math.log(beta + eps) - 1

        a = step / float(warmup)
        return math.pow(0.5, 1 / ((1.0 - a) * half_life(beta1) + a * half_life(beta3) + 1))
    return beta3


def _ademamix_states(flags: dict) -> tuple[StateSpec, ...]:
    fast = (StateSpec("exp_avg_fast", True),) if flags["fast"] else ()
    return fast + (StateSpec("exp_avg_slow", True), StateSpec("exp_avg_sq", False))


def _ademamix_scalars(group: dict, step: int) -> dict[str, float]:
    beta1, beta2, beta3 = group["betas"]
    beta3 = beta3_at(step, beta3, beta1, group["beta3_warmup"])
    # the EMA weights 1 - beta in double: a float32 beta near 1 holds 1 - beta only to about
    # 2e-4 relative (1 - float32(0.9999) is 1.00017e-4), which kernels with float32 scalars would use
    return {
        "beta1": beta1, "beta2": beta2, "beta3": beta3,
        "one_minus_beta1": 1 - beta1, "one_minus_beta2": 1 - beta2, "one_minus_beta3": 1 - beta3,
        "alpha": alpha_at(step, group["alpha"], group["alpha_warmup"]), "eps": group["eps"],
        "weight_decay": group["weight_decay"], "bias_correction1": 1 - beta1**step,
        "bias_correction2_sqrt": math.sqrt(1 - beta2**step),
    }


def _ademamix_math(p: Tensor, g: Tensor, states: Sequence[Tensor], h: dict,
                   flags: dict) -> tuple[Tensor, list[Tensor]]:
    g = gradient(g, h, flags)
    new: list[Tensor] = []
    if flags["fast"]:
        m1 = add(states[0] * h["beta1"], g, h["one_minus_beta1"])
        new.append(m1)
    else:
        m1 = g
    m2 = add(states[-2] * h["beta3"], g, h["one_minus_beta3"])
    v = addcmul(states[-1] * h["beta2"], g, g, h["one_minus_beta2"])
    new += [m2, v]
    denom = v.sqrt() / h["bias_correction2_sqrt"]
    denom = denom + h["eps"] if is_tensor(h["eps"]) else denom.add(h["eps"])
    update = (m1 / h["bias_correction1"] + h["alpha"] * m2) / denom
    wd = h["weight_decay"]
    if is_tensor(wd) or wd != 0:
        update = add(update, p, wd)
    return p + -h["lr"] * update, new


ADEMAMIX = register_rule(UpdateRule(
    "ademamix", _ademamix_states,
    ("lr", "grad_unscale", "beta1", "beta2", "beta3", "one_minus_beta1", "one_minus_beta2", "one_minus_beta3",
     "alpha", "eps", "weight_decay", "bias_correction1", "bias_correction2_sqrt"),
    _ademamix_scalars, _ademamix_math,
))


class AdEMAMix(QuantizedOptimizer):
    """AdEMAMix with quantized moments (the arguments of the authors' ``AdEMAMix``); the state policy's
    keywords are :class:`~qstate.optim.StatePolicy`'s."""

    rule = ADEMAMIX

    def __init__(self, params: Iterable, lr: LR = 1e-3, betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 alpha: float = 2.0, beta3_warmup: Optional[int] = None, alpha_warmup: Optional[int] = None,
                 eps: float = 1e-8, weight_decay: float = 0.0, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, **policy: Any):
        defaults = dict(lr=lr, betas=tuple(betas), alpha=alpha, beta3_warmup=beta3_warmup,
                        alpha_warmup=alpha_warmup, eps=eps, weight_decay=weight_decay, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, **policy)

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        check_lr(name, group["lr"])
        betas = tuple(group["betas"])
        if len(betas) != 3 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{name}: invalid betas {betas}: expected three values in [0, 1)")
        check_non_negative(name, "alpha value", group["alpha"])
        check_non_negative(name, "epsilon value", group["eps"])
        check_non_negative(name, "weight_decay value", group["weight_decay"])
        for warmup in ("beta3_warmup", "alpha_warmup"):
            value = group[warmup]
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: invalid {warmup}: {value!r}: expected None or a positive int")
        check_implementation(name, group)

    def rule_flags(self, group: dict) -> dict:
        return {"maximize": bool(group["maximize"]), "fast": group["betas"][0] != 0}


def ademamix(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg_fasts: Optional[Sequence[Tensor]],
             exp_avg_slows: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor],
             state_steps: Sequence[Union[int, Tensor]], *, lr: Scalar, beta1: float, beta2: float, beta3: float,
             alpha: float, eps: float, weight_decay: float, beta3_warmup: Optional[int] = None,
             alpha_warmup: Optional[int] = None, maximize: bool = False, compile: bool = False,
             stochastic_round: bool = False, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None) -> None:
    """AdEMAMix (:class:`AdEMAMix` semantics). ``exp_avg_fasts`` is None when ``beta1 == 0``."""
    fast = beta1 != 0
    if fast and exp_avg_fasts is None:
        raise ValueError("ademamix: beta1 != 0 needs exp_avg_fasts")
    check_lists("ademamix", params=params, grads=grads, exp_avg_fasts=exp_avg_fasts if fast else None,
                exp_avg_slows=exp_avg_slows, exp_avg_sqs=exp_avg_sqs, state_steps=state_steps)
    states = [([exp_avg_fasts[i]] if fast else []) + [m2, v] for i, (m2, v) in enumerate(zip(exp_avg_slows, exp_avg_sqs))]
    group = {"betas": (beta1, beta2, beta3), "alpha": alpha, "beta3_warmup": beta3_warmup,
             "alpha_warmup": alpha_warmup, "eps": eps, "weight_decay": weight_decay}
    apply_update(ADEMAMIX, {"maximize": maximize, "fast": fast}, params, grads, states, state_steps, group,
                 lr=lr, compile=compile, stochastic_round=stochastic_round, grad_scale=grad_scale,
                 found_inf=found_inf)

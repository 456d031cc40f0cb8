"""Adam and AdamW with quantized moments: the rule's math, the classes and the functional forms.

``exp_avg`` (signed) and ``exp_avg_sq`` (unsigned; ``max_exp_avg_sq`` too with ``amsgrad``) follow
``torch.optim.Adam``; with fp32 states the eager math is torch's, op for op. The step keeps
``|m| <= K_t sqrt(v)`` (:func:`adam_bound`), which exact fp32 Adam always satisfies, so quantized
moments read back with independent errors never make an update fp32 Adam could not make.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor

from ._arguments import LR, check_betas, check_implementation, check_lr, check_non_negative
from ._base import QuantizedOptimizer
from .rules import StateSpec, UpdateRule, add, addcdiv, addcmul, gradient, is_tensor, register_rule
from ._engine import Scalar, apply_update, check_lists

__all__ = ["ADAM", "Adam", "AdamW", "adam", "adam_bound", "adam_update_bound", "adamw"]


def adam_bound(beta1: float, beta2: float, step: int) -> float:
    """``K_t``: fp32 Adam always has ``|m_t| <= K_t * sqrt(v_t)`` (Cauchy-Schwarz).

    ``m_t = (1-b1) sum b1^(t-i) g_i`` and ``v_t = (1-b2) sum b2^(t-i) g_i^2`` give
    ``|m_t| <= (1-b1) sqrt(sum_{k<t} (b1^2/b2)^k / (1-b2)) sqrt(v_t)``, so the
    bias-corrected step ``|lr * m_hat / (sqrt(v_hat) + eps)|`` never exceeds
    ``lr * K_t * sqrt(1-b2^t) / (1-b1^t)``. With quantized moments the pair
    (m, v) read back can violate this; the update clamps ``|m|`` to it.
    """
    if beta2 <= 0 or beta2 >= 1:  # no finite bound; large but finite so that 0 * bound == 0
        return 1e30
    r = beta1 * beta1 / beta2
    s = float(step) if r == 1 else (1 - r**step) / (1 - r)
    return (1 - beta1) * math.sqrt(s / (1 - beta2))


def adam_update_bound(beta1: float, beta2: float, step: int) -> float:
    """The largest ``|update| / lr`` fp32 Adam can produce at ``step``."""
    return adam_bound(beta1, beta2, step) * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def _adam_states(flags: dict) -> tuple[StateSpec, ...]:
    s = (StateSpec("exp_avg", True), StateSpec("exp_avg_sq", False))
    return s + ((StateSpec("max_exp_avg_sq", False),) if flags["amsgrad"] else ())


def _adam_scalars(group: dict, step: int) -> dict[str, float]:
    beta1, beta2 = group["betas"]
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return {
        "beta1": beta1, "beta2": beta2, "eps": group["eps"], "weight_decay": group["weight_decay"],
        "bias_correction1": bias_correction1, "bias_correction2_sqrt": bias_correction2**0.5,
        # relative slack: float rounding of the bound itself must never bind on fp32 states
        "m_bound": adam_bound(beta1, beta2, step) * (1 + 1e-5),
    }


def _adam_math(p: Tensor, g: Tensor, states: Sequence[Tensor], h: dict, flags: dict) -> tuple[Tensor, list[Tensor]]:
    exp_avg, exp_avg_sq = states[0], states[1]
    lr, wd = h["lr"], h["weight_decay"]
    g = gradient(g, h, flags)
    if is_tensor(wd) or wd != 0:
        if flags["decoupled"]:
            p = p * (1 - lr * wd) if is_tensor(wd) or is_tensor(lr) else p.mul(1 - lr * wd)
        else:
            g = add(g, p, wd)
    m = exp_avg.lerp(g, 1 - h["beta1"])
    v = addcmul(exp_avg_sq.mul(h["beta2"]), g, g, 1 - h["beta2"])
    new = [m, v]
    if flags["amsgrad"]:
        v = torch.maximum(states[2], v)
        new.append(v)
    sqrt_v = v.sqrt()
    # keep (m, v) consistent as exact fp32 Adam always is (see adam_bound); only binds when
    # quantized moments were read back with independent errors
    limit = sqrt_v * h["m_bound"]
    m = torch.minimum(torch.maximum(m, -limit), limit)
    step_size = lr / h["bias_correction1"]
    denom = sqrt_v / h["bias_correction2_sqrt"]
    denom = denom + h["eps"] if is_tensor(h["eps"]) else denom.add(h["eps"])
    return addcdiv(p, m, denom, -step_size), new


ADAM = register_rule(UpdateRule(
    "adam", _adam_states,
    ("lr", "grad_unscale", "beta1", "beta2", "eps", "weight_decay", "bias_correction1", "bias_correction2_sqrt",
     "m_bound"),
    _adam_scalars, _adam_math,
))


class Adam(QuantizedOptimizer):
    """Adam with quantized moments (``torch.optim.Adam`` arguments and semantics); the state policy's
    keywords (``state_format``, ``seed``, ...) are :class:`~qstate.optim.StatePolicy`'s."""

    rule = ADAM
    _decoupled_default = False

    def __init__(self, params: Iterable, lr: LR = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: Optional[bool] = None, **policy: Any):
        decoupled = self._decoupled_default if decoupled_weight_decay is None else decoupled_weight_decay
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=decoupled)
        super().__init__(params, defaults, **policy)

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        check_lr(name, group["lr"])
        check_betas(name, group["betas"])
        check_non_negative(name, "epsilon value", group["eps"])
        check_non_negative(name, "weight_decay value", group["weight_decay"])
        check_implementation(name, group)

    def rule_flags(self, group: dict) -> dict:
        return {"amsgrad": bool(group["amsgrad"]), "maximize": bool(group["maximize"]),
                "decoupled": bool(group["decoupled_weight_decay"])}


class AdamW(Adam):
    """AdamW with quantized moments (``torch.optim.AdamW`` arguments and semantics); the state policy's
    keywords are :class:`~qstate.optim.StatePolicy`'s."""

    _decoupled_default = True

    def __init__(self, params: Iterable, lr: LR = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, **policy: Any):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, **policy)


def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], state_steps: Sequence[Union[int, Tensor]], *,
         max_exp_avg_sqs: Optional[Sequence[Tensor]] = None, lr: Scalar, beta1: float, beta2: float,
         eps: float, weight_decay: float, amsgrad: bool = False, maximize: bool = False,
         decoupled_weight_decay: bool = False, compile: bool = False, stochastic_round: bool = False,
        grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """Adam (``torch.optim.Adam`` semantics); ``decoupled_weight_decay=True`` is AdamW.

    The step keeps ``|m| <= K_t sqrt(v)``, a bound exact fp32 Adam always
    satisfies (``qstate.optim.adam_update_bound``): with quantized moments read
    back with independent errors no update exceeds what fp32 Adam could do;
    with fp32 states it never binds.
    """
    check_lists("adam", params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                 state_steps=state_steps, max_exp_avg_sqs=max_exp_avg_sqs if amsgrad else None)
    if amsgrad and max_exp_avg_sqs is None:
        raise ValueError("adam: amsgrad=True needs max_exp_avg_sqs")
    states = [[m, v] + ([max_exp_avg_sqs[i]] if amsgrad else []) for i, (m, v) in enumerate(zip(exp_avgs, exp_avg_sqs))]
    group = {"betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay}
    flags = {"amsgrad": amsgrad, "maximize": maximize, "decoupled": decoupled_weight_decay}
    apply_update(ADAM, flags, params, grads, states, state_steps, group, lr=lr, compile=compile,
                 stochastic_round=stochastic_round, grad_scale=grad_scale, found_inf=found_inf)


def adamw(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
          exp_avg_sqs: Sequence[Tensor], state_steps: Sequence[Union[int, Tensor]], *,
          max_exp_avg_sqs: Optional[Sequence[Tensor]] = None, lr: Scalar, beta1: float, beta2: float,
          eps: float, weight_decay: float, amsgrad: bool = False, maximize: bool = False,
          compile: bool = False, stochastic_round: bool = False,
        grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """AdamW (``torch.optim.AdamW`` semantics): Adam with decoupled weight decay."""
    adam(params, grads, exp_avgs, exp_avg_sqs, state_steps, max_exp_avg_sqs=max_exp_avg_sqs, lr=lr,
         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
         decoupled_weight_decay=True, compile=compile, stochastic_round=stochastic_round, grad_scale=grad_scale,
         found_inf=found_inf)

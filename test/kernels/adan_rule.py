"""Adan (Xie et al., 2022, "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models") as a
library built on qstate would write it: an ``UpdateRule`` registered through the public API, a
``QuantizedOptimizer`` subclass, and the authors' reference step over plain tensors. Not a qstate optimizer:
the tests (``test_generated_rules.py``) and ``benchmarks/bench_rules.py`` use it as a third party's rule.
"""

from __future__ import annotations

import math

import torch

from qstate.optim import QuantizedOptimizer, StateSpec, UpdateRule, register_rule

__all__ = ["ADAN", "Adan", "adan_math", "adan_reference_step"]


def _adan_states(flags: dict) -> tuple:
    return (StateSpec("exp_avg", True), StateSpec("exp_avg_diff", True), StateSpec("exp_avg_sq", False),
            StateSpec("prev_grad", True))


def _adan_scalars(group: dict, step: int) -> dict:
    beta1, beta2, beta3 = group["betas"]
    return {"beta1": beta1, "beta2": beta2, "beta3": beta3, "eps": group["eps"],
            "weight_decay": group["weight_decay"], "bias_correction1": 1 - beta1**step,
            "bias_correction2": 1 - beta2**step, "bias_correction3_sqrt": math.sqrt(1 - beta3**step),
            # the first step has no previous gradient: its difference is 0 (prev_grad starts at zeros)
            "diff_scale": 0.0 if step == 1 else 1.0}


def adan_math(p, g, states, h, flags):
    """Adan (Xie et al., 2022, Algorithm 1, the authors' ``betas`` convention: ``beta = 1 - paper's beta``),
    with its proximal weight decay; plain torch ops, for float and 0-dim tensor scalars alike."""
    m, d, n, prev = states
    g = g * h["grad_unscale"]
    if flags["maximize"]:
        g = -g
    diff = (g - prev) * h["diff_scale"]
    u = g + h["beta2"] * diff
    m = m * h["beta1"] + g * (1 - h["beta1"])
    d = d * h["beta2"] + diff * (1 - h["beta2"])
    n = n * h["beta3"] + u * u * (1 - h["beta3"])
    denom = n.sqrt() / h["bias_correction3_sqrt"] + h["eps"]
    update = (m / h["bias_correction1"] + h["beta2"] * d / h["bias_correction2"]) / denom
    p = (p - h["lr"] * update) / (1 + h["lr"] * h["weight_decay"])
    return p, [m, d, n, g]


ADAN = register_rule(UpdateRule(
    "test_adan", _adan_states,
    ("lr", "grad_unscale", "beta1", "beta2", "beta3", "eps", "weight_decay", "bias_correction1",
     "bias_correction2", "bias_correction3_sqrt", "diff_scale"),
    _adan_scalars, adan_math))


class Adan(QuantizedOptimizer):
    """Adan with qstate's states, as a library built on qstate would write it."""

    rule = ADAN

    def __init__(self, params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0, *, maximize=False,
                 state_format="8bit", block_size=None, min_quantize_numel=4096, compile=True, seed=0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize),
                         state_format=state_format, block_size=block_size, min_quantize_numel=min_quantize_numel,
                         bf16_stochastic_round=False, compile=compile, seed=seed)

    def rule_flags(self, group: dict) -> dict:
        return {"maximize": bool(group["maximize"])}


def adan_reference_step(params, states, lr, betas, eps, weight_decay):
    """The authors' ``_single_tensor_adan`` (sail-sg/Adan, ``no_prox=False``) over plain float32 tensors."""
    beta1, beta2, beta3 = betas
    for p in params:
        grad = p.grad
        state = states.setdefault(p, {})
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                         exp_avg_diff=torch.zeros_like(p), pre_grad=grad.clone())
        state["step"] += 1
        step = state["step"]
        bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
        bias_correction3_sqrt = math.sqrt(1 - beta3**step)
        diff = grad - state["pre_grad"]
        update = grad + beta2 * diff
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        state["exp_avg_diff"].mul_(beta2).add_(diff, alpha=1 - beta2)
        state["exp_avg_sq"].mul_(beta3).addcmul_(update, update, value=1 - beta3)
        denom = (state["exp_avg_sq"].sqrt() / bias_correction3_sqrt).add_(eps)
        update = (state["exp_avg"] / bias_correction1 + beta2 * state["exp_avg_diff"] / bias_correction2).div_(denom)
        p.add_(update, alpha=-lr)
        p.div_(1 + lr * weight_decay)
        state["pre_grad"].copy_(grad)

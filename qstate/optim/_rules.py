"""The elementwise math of each optimizer, written once for every execution path.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

__all__ = ["StateSpec", "UpdateRule", "RULES", "adam_bound"]


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


def _is_t(x: Any) -> bool:
    return isinstance(x, Tensor)


def _add(x: Tensor, y: Tensor, alpha: Any) -> Tensor:
    """``x + alpha * y`` (``torch.add(alpha=)`` when ``alpha`` is a number, as torch.optim)."""
    return x + alpha * y if _is_t(alpha) else x.add(y, alpha=alpha)


def _addcmul(x: Tensor, a: Tensor, b: Tensor, value: Any) -> Tensor:
    return x + a * b * value if _is_t(value) else x.addcmul(a, b, value=value)


def _addcdiv(x: Tensor, a: Tensor, b: Tensor, value: Any) -> Tensor:
    return x + value * (a / b) if _is_t(value) else x.addcdiv(a, b, value=value)


def _gradient(g: Tensor, h: dict, flags: dict) -> Tensor:
    """The gradient the rule follows: unscaled by ``grad_unscale`` (AMP), negated if ``maximize``.

    ``grad_unscale`` is ``1 / grad_scale`` of a gradient scaler (``1.0`` without one): the unscale is
    fused into the update, so the scaled gradient is read once and never written.
    """
    inv = h["grad_unscale"]
    if _is_t(inv) or inv != 1.0:
        g = g * inv
    return -g if flags["maximize"] else g


# ---------------------------------------------------------------- Adam / AdamW
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
    g = _gradient(g, h, flags)
    if _is_t(wd) or wd != 0:
        if flags["decoupled"]:
            p = p * (1 - lr * wd) if _is_t(wd) or _is_t(lr) else p.mul(1 - lr * wd)
        else:
            g = _add(g, p, wd)
    m = exp_avg.lerp(g, 1 - h["beta1"])
    v = _addcmul(exp_avg_sq.mul(h["beta2"]), g, g, 1 - h["beta2"])
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
    denom = denom + h["eps"] if _is_t(h["eps"]) else denom.add(h["eps"])
    return _addcdiv(p, m, denom, -step_size), new


ADAM = UpdateRule(
    "adam", _adam_states,
    ("lr", "grad_unscale", "beta1", "beta2", "eps", "weight_decay", "bias_correction1", "bias_correction2_sqrt",
     "m_bound"),
    _adam_scalars, _adam_math,
)


# ---------------------------------------------------------------- Lion
def _lion_states(flags: dict) -> tuple[StateSpec, ...]:
    return (StateSpec("exp_avg", True),)


def _lion_scalars(group: dict, step: int) -> dict[str, float]:
    beta1, beta2 = group["betas"]
    return {"beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"]}


def _lion_math(p: Tensor, g: Tensor, states: Sequence[Tensor], h: dict, flags: dict) -> tuple[Tensor, list[Tensor]]:
    (exp_avg,) = states
    lr, wd = h["lr"], h["weight_decay"]
    g = _gradient(g, h, flags)
    if _is_t(wd) or wd != 0:
        p = p * (1 - lr * wd) if _is_t(wd) or _is_t(lr) else p.mul(1 - lr * wd)
    direction = exp_avg.lerp(g, 1 - h["beta1"]).sign()
    p = _add(p, direction, -lr)
    return p, [exp_avg.lerp(g, 1 - h["beta2"])]


LION = UpdateRule("lion", _lion_states, ("lr", "grad_unscale", "beta1", "beta2", "weight_decay"), _lion_scalars,
                  _lion_math)


# ---------------------------------------------------------------- SGD (momentum)
def _sgd_states(flags: dict) -> tuple[StateSpec, ...]:
    return (StateSpec("momentum_buffer", True),) if flags["momentum"] else ()


def _sgd_scalars(group: dict, step: int) -> dict[str, float]:
    first = step == 1
    return {
        "momentum": group["momentum"], "weight_decay": group["weight_decay"],
        # torch.optim.SGD starts the buffer as a copy of the first gradient
        "buf_keep": 0.0 if first else group["momentum"],
        "grad_keep": 1.0 if first else 1 - group["dampening"],
    }


def _sgd_math(p: Tensor, g: Tensor, states: Sequence[Tensor], h: dict, flags: dict) -> tuple[Tensor, list[Tensor]]:
    lr, wd = h["lr"], h["weight_decay"]
    g = _gradient(g, h, flags)
    if _is_t(wd) or wd != 0:
        g = _add(g, p, wd)
    new: list[Tensor] = []
    if flags["momentum"]:
        (buf,) = states
        if _is_t(h["buf_keep"]):
            buf = buf * h["buf_keep"] + g * h["grad_keep"]
        elif h["buf_keep"] == 0.0 and h["grad_keep"] == 1.0:
            buf = g.clone()
        else:
            buf = buf.mul(h["buf_keep"]).add(g, alpha=h["grad_keep"])
        new.append(buf)
        g = _add(g, buf, h["momentum"]) if flags["nesterov"] else buf
    return _add(p, g, -lr), new


SGD = UpdateRule("sgd", _sgd_states, ("lr", "grad_unscale", "momentum", "weight_decay", "buf_keep", "grad_keep"),
                 _sgd_scalars, _sgd_math)

RULES = {r.name: r for r in (ADAM, LION, SGD)}

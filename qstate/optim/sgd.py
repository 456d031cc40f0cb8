"""SGD with a quantized momentum buffer (``torch.optim.SGD`` semantics): the rule's math, the class and
the functional form.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, Union

from torch import Tensor

from ._arguments import LR, check_implementation, check_lr, check_non_negative
from ._base import QuantizedOptimizer
from .rules import StateSpec, UpdateRule, add, gradient, is_tensor, register_rule
from ._engine import Scalar, apply_update, check_lists

__all__ = ["SGD", "SGD_RULE", "sgd"]


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
    g = gradient(g, h, flags)
    if is_tensor(wd) or wd != 0:
        g = add(g, p, wd)
    new: list[Tensor] = []
    if flags["momentum"]:
        (buf,) = states
        if is_tensor(h["buf_keep"]):
            buf = buf * h["buf_keep"] + g * h["grad_keep"]
        elif h["buf_keep"] == 0.0 and h["grad_keep"] == 1.0:
            buf = g.clone()
        else:
            buf = buf.mul(h["buf_keep"]).add(g, alpha=h["grad_keep"])
        new.append(buf)
        g = add(g, buf, h["momentum"]) if flags["nesterov"] else buf
    return add(p, g, -lr), new


SGD_RULE = register_rule(UpdateRule("sgd", _sgd_states, ("lr", "grad_unscale", "momentum", "weight_decay", "buf_keep", "grad_keep"),
                 _sgd_scalars, _sgd_math))


class SGD(QuantizedOptimizer):
    """SGD with a quantized momentum buffer (``torch.optim.SGD`` arguments and semantics); the state
    policy's keywords are :class:`~qstate.optim.StatePolicy`'s."""

    rule = SGD_RULE

    def __init__(self, params: Iterable, lr: LR = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None,
                 **policy: Any):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults, **policy)

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        check_lr(name, group["lr"])
        check_non_negative(name, "momentum value", group["momentum"])
        check_non_negative(name, "weight_decay value", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{name}: nesterov momentum requires a momentum and zero dampening")
        check_implementation(name, group)

    def rule_flags(self, group: dict) -> dict:
        return {"maximize": bool(group["maximize"]), "momentum": group["momentum"] != 0,
                "nesterov": bool(group["nesterov"])}


def sgd(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Optional[Tensor]],
        state_steps: Sequence[Union[int, Tensor]], *, lr: Scalar, momentum: float, dampening: float = 0.0,
        weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False, compile: bool = False,
        stochastic_round: bool = False,
        grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """SGD with momentum (``torch.optim.SGD`` semantics).

    The momentum buffers start as zeros (quantized or plain); at step 1 the
    buffer becomes the gradient, as ``torch.optim.SGD``'s first-step clone.
    """
    check_lists("sgd", params=params, grads=grads, momentum_buffers=momentum_buffers, state_steps=state_steps)
    group = {"momentum": momentum, "dampening": dampening, "weight_decay": weight_decay}
    states = [[b] if momentum else [] for b in momentum_buffers]
    flags = {"maximize": maximize, "momentum": bool(momentum), "nesterov": nesterov}
    apply_update(SGD_RULE, flags, params, grads, states, state_steps, group, lr=lr, compile=compile,
                 stochastic_round=stochastic_round, grad_scale=grad_scale, found_inf=found_inf)

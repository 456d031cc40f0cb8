"""The optimizer table (in the shape of torch's ``optim_db``): one :class:`OptimizerInfo` per qstate optimizer.

No tests here. ``test_optim_db.py`` parametrizes its tests from :data:`optim_db` only, and
``test_optim_fsdp.py`` takes its optimizers' arguments from it; a new optimizer needs a new entry
(``test_optim_db.py::test_table_covers_every_public_optimizer`` fails without one).

Each entry gives:

* ``optim_cls``: the qstate class, built as ``optim_cls(params, **input.kwargs, state_format=...,
  min_quantize_numel=..., compile=...)``;
* ``reference``: a plain-PyTorch optimizer built from the same ``params`` and ``kwargs``
  (``torch.optim.AdamW``/``Adam``/``SGD`` with ``foreach=False``; the published algorithm written
  out below for Lion and AdEMAMix; ``torch.optim.Muon`` for the 2-D parameters of Muon and
  ``torch.optim.AdamW`` for the others). Its states carry qstate's state names;
* ``inputs``: configurations (constructor keyword arguments besides the state policy), each with
  the number of states it keeps for a quantized (2-D) parameter; ``inputs[0]`` is the one run
  under FSDP2;
* ``tolerances``: per state format, how far parameters and states may end from the reference's
  after :data:`STEPS` steps op by op (``compile=False``), and ``fused_tolerances`` with the fused
  kernels (``compile=True``) (:class:`Tolerance`; the reasons are at :data:`EXACT`, :data:`FUSED_FP32`
  and :data:`QUANTIZED`);
* ``takes_seed``: whether the table's runs pass ``seed`` and ``bf16_stochastic_round`` (Muon rounds no bf16 parameter);
* ``elementwise``: whether each element's update reads only that element (then a sharded step
  issues no collective).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor

import qstate.optim

#: steps every table test runs
STEPS = 3


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a run may end from its reference after :data:`STEPS` steps from the same parameters
    and gradients. Parameters: the largest and the mean ``|p - p_ref|`` of each tensor, in units of
    ``lr * STEPS`` (the input's ``lr``: about as far as the optimizers move a parameter in that many
    steps); states: the largest ``|s - s_ref|`` of each state tensor over its largest
    ``|s_ref|`` (quantized states dequantized). All zero asks for equality."""

    param_max: float
    param_mean: float
    state: float

    @property
    def exact(self) -> bool:
        return self.param_max == self.param_mean == self.state == 0


@dataclasses.dataclass(frozen=True)
class OptimizerInput:
    """One configuration: the constructor's keyword arguments besides the state policy."""

    kwargs: Mapping[str, Any]
    desc: str
    #: states (besides ``step``) a quantized parameter keeps: ``ndim >= 2`` and numel at least the policy's
    matrix_states: int


@dataclasses.dataclass(frozen=True)
class OptimizerInfo:
    """One qstate optimizer: what its tests build, what they compare it with, and how closely."""

    optim_cls: type
    #: ``reference(params, **kwargs)``: the plain-PyTorch optimizer of the same configuration
    reference: Callable[..., Any]
    inputs: tuple[OptimizerInput, ...]
    #: per state format (every one of ``qstate.optim.STATE_FORMATS()``): how close to the reference op by
    #: op (``compile=False``) and with the fused kernels (``compile=True``)
    tolerances: Mapping[str, Tolerance]
    fused_tolerances: Mapping[str, Tolerance]
    takes_seed: bool = True
    elementwise: bool = True

    @property
    def name(self) -> str:
        return self.optim_cls.__name__

    @property
    def fsdp_input(self) -> OptimizerInput:
        return self.inputs[0]


# ------------------------------------------------------------------ references written from the papers
class LionReference(torch.optim.Optimizer):
    """Lion (Chen et al., 2023, Algorithm 2) in plain torch, with decoupled weight decay and ``maximize``."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, maximize: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                g = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - lr * wd)
                p.add_((exp_avg * beta1 + g * (1 - beta1)).sign(), alpha=-lr)
                exp_avg.mul_(beta2).add_(g, alpha=1 - beta2)


class AdEMAMixReference(torch.optim.Optimizer):
    """AdEMAMix (Pagliardini et al., 2024): the authors' ``AdEMAMix.step`` (``apple/ml-ademamix``) in plain
    torch, with ``maximize``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 alpha: float = 2.0, beta3_warmup: Optional[int] = None, alpha_warmup: Optional[int] = None,
                 eps: float = 1e-8, weight_decay: float = 0.0, maximize: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, alpha=alpha, beta3_warmup=beta3_warmup,
                                      alpha_warmup=alpha_warmup, eps=eps, weight_decay=weight_decay,
                                      maximize=maximize))

    @staticmethod
    def _alpha(step: int, alpha: float, warmup: Optional[int]) -> float:
        return alpha * step / warmup if warmup is not None and step < warmup else alpha

    @staticmethod
    def _beta3(step: int, beta3: float, beta1: float, warmup: Optional[int]) -> float:
        if warmup is None or step >= warmup:
            return beta3

        def half_life(beta: float, eps: float = 1e-8) -> float:
            return math.log(0.5) / math.log(beta + eps) - 1

        a = step / warmup
        return math.pow(0.5, 1 / ((1.0 - a) * half_life(beta1) + a * half_life(beta3) + 1))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2, beta3_final = group["betas"]
            for p in group["params"]:
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    if beta1 != 0.0:
                        state["exp_avg_fast"] = torch.zeros_like(p)
                    state["exp_avg_slow"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"]
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                alpha = self._alpha(step, group["alpha"], group["alpha_warmup"])
                beta3 = self._beta3(step, beta3_final, beta1, group["beta3_warmup"])
                if beta1 != 0.0:
                    exp_avg_fast = state["exp_avg_fast"].mul_(beta1).add_(grad, alpha=1 - beta1)
                else:
                    exp_avg_fast = grad
                exp_avg_slow = state["exp_avg_slow"].mul_(beta3).add_(grad, alpha=1 - beta3)
                exp_avg_sq = state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                update = (exp_avg_fast.div(bias_correction1) + alpha * exp_avg_slow) / denom
                update.add_(p, alpha=group["weight_decay"])
                p.add_(-group["lr"] * update)


class Optimizers:
    """Several torch optimizers over disjoint parameters, stepped as one (``state``: all of theirs)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


def muon_reference(params: Sequence[Tensor], *, adamw_lr: float = 1e-3, adamw_betas=(0.9, 0.999),
                   adamw_eps: float = 1e-8, adamw_weight_decay: float = 1e-2, **muon_kwargs) -> Optimizers:
    """``torch.optim.Muon`` on the 2-D parameters, ``torch.optim.AdamW`` (the ``adamw_`` arguments) on the
    others: how ``qstate.optim.Muon`` splits a group that does not say ``use_muon``."""
    params = list(params)
    matrices, others = [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]
    opts = [torch.optim.Muon(matrices, **muon_kwargs)] if matrices else []
    if others:
        opts.append(torch.optim.AdamW(others, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                      weight_decay=adamw_weight_decay, foreach=False))
    return Optimizers(*opts)


def _unrolled(cls: type) -> Callable[..., torch.optim.Optimizer]:
    """``cls`` with its for-loop implementation (``foreach=False``), the one qstate's eager math follows."""
    def build(params, **kwargs):
        return cls(params, foreach=False, **kwargs)

    build.__name__ = build.__qualname__ = f"{cls.__name__}(foreach=False)"
    return build


# ------------------------------------------------------------------ tolerances
#: float32 states: qstate's eager math is the reference's op for op (torch's for-loop AdamW, Adam and
#: SGD; torch.optim.Muon's Newton-Schulz; the published Lion and AdEMAMix steps), so equal results
EXACT = Tolerance(0.0, 0.0, 0.0)
#: float32 states with ``compile=True``: the fused kernels contract multiply-adds and reassociate, so a
#: few float32 ulps from the reference (at most 2.4e-5 lr*steps on parameters and 1.3e-5 on states with
#: the table's inputs)
FUSED_FP32 = Tolerance(param_max=1e-4, param_mean=1e-5, state=5e-5)

#: states stored in fewer bits. A state read back with a relative error ``e`` changes a step's move by
#: about ``e`` of it, so parameters drift apart by a fraction of ``lr`` per step: bfloat16 states (8-bit
#: mantissa) a fraction of a percent, 8-bit codes (256 values per block) about a percent, fp8 codes
#: (3-bit mantissa) a few, 4-bit codes (16 values per block) tens of percent. Each bound is about twice
#: the largest the table's inputs reach (the same on torch 2.13 and 2.14; a failing assertion prints
#: the value it found), so a state read with its sign or scale wrong (an error of the whole move) fails.
QUANTIZED = {
    "bf16": Tolerance(param_max=0.02, param_mean=0.003, state=0.01),
    "8bit": Tolerance(param_max=0.1, param_mean=0.015, state=0.04),
    "fp8": Tolerance(param_max=0.4, param_mean=0.03, state=0.15),
    "4bit": Tolerance(param_max=1.25, param_mean=0.15, state=0.75),
}


def _tolerances(fp32: Tolerance = EXACT, param_max: Optional[float] = None) -> dict[str, Tolerance]:
    """Every state format's tolerance: ``fp32`` for float32 states, :data:`QUANTIZED` for the others
    (``param_max`` replacing their largest parameter difference)."""
    quantized = {fmt: tol if param_max is None else dataclasses.replace(tol, param_max=param_max)
                 for fmt, tol in QUANTIZED.items()}
    return {"fp32": fp32, **quantized}


# ------------------------------------------------------------------ the table
_ADAM_LR = 1e-2

optim_db: list[OptimizerInfo] = [
    OptimizerInfo(
        qstate.optim.AdamW, _unrolled(torch.optim.AdamW),
        inputs=(
            OptimizerInput(dict(lr=_ADAM_LR, betas=(0.9, 0.99), weight_decay=0.1), "weight_decay", 2),
            OptimizerInput(dict(lr=_ADAM_LR, betas=(0.8, 0.99), weight_decay=0.0, amsgrad=True, maximize=True),
                           "amsgrad, maximize", 3),
        ),
        tolerances=_tolerances(), fused_tolerances=_tolerances(fp32=FUSED_FP32),
    ),
    OptimizerInfo(
        qstate.optim.Adam, _unrolled(torch.optim.Adam),
        inputs=(
            OptimizerInput(dict(lr=_ADAM_LR, betas=(0.9, 0.99), weight_decay=0.1), "L2 weight_decay", 2),
            OptimizerInput(dict(lr=_ADAM_LR, amsgrad=True, eps=1e-6), "amsgrad", 3),
        ),
        tolerances=_tolerances(), fused_tolerances=_tolerances(fp32=FUSED_FP32),
    ),
    OptimizerInfo(
        qstate.optim.SGD, _unrolled(torch.optim.SGD),
        inputs=(
            OptimizerInput(dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2), "nesterov", 1),
            OptimizerInput(dict(lr=1e-2, momentum=0.9, maximize=True), "momentum, maximize", 1),
            OptimizerInput(dict(lr=1e-2, momentum=0.5, dampening=0.3), "dampening", 1),
            OptimizerInput(dict(lr=1e-2), "no momentum", 0),
        ),
        tolerances=_tolerances(), fused_tolerances=_tolerances(fp32=FUSED_FP32),
    ),
    OptimizerInfo(
        qstate.optim.Lion, LionReference,
        inputs=(
            OptimizerInput(dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1), "weight_decay", 1),
            OptimizerInput(dict(lr=1e-3, betas=(0.95, 0.98), maximize=True), "maximize", 1),
        ),
        # float32: the momentum by ``lerp`` (the reference's: ``mul``, ``add``), an ulp apart. Other formats:
        # an element whose direction (a sign) the state's error puts on the other side of zero moves by
        # 2 lr the other way, so the largest difference only says that (2 lr every step); the mean bounds
        # how many elements flip
        tolerances=_tolerances(fp32=Tolerance(0.0, 0.0, 1e-6), param_max=2.0),
        fused_tolerances=_tolerances(fp32=FUSED_FP32, param_max=2.0),
    ),
    OptimizerInfo(
        qstate.optim.AdEMAMix, AdEMAMixReference,
        inputs=(
            OptimizerInput(dict(lr=_ADAM_LR, betas=(0.9, 0.99, 0.999), alpha=5.0, alpha_warmup=2, weight_decay=0.1),
                           "alpha warmup, weight_decay", 3),
            OptimizerInput(dict(lr=_ADAM_LR, betas=(0.0, 0.99, 0.999), beta3_warmup=2, maximize=True),
                           "no fast EMA, beta3 warmup, maximize", 2),
        ),
        tolerances=_tolerances(), fused_tolerances=_tolerances(fp32=FUSED_FP32),
    ),
    OptimizerInfo(
        qstate.optim.Muon, muon_reference,
        inputs=(
            OptimizerInput(dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adamw_lr=_ADAM_LR),
                           "nesterov", 1),
            OptimizerInput(dict(lr=0.02, momentum=0.9, nesterov=False, adjust_lr_fn="match_rms_adamw",
                                adamw_lr=_ADAM_LR, adamw_weight_decay=0.0), "match_rms_adamw", 1),
        ),
        tolerances=_tolerances(), fused_tolerances=_tolerances(fp32=FUSED_FP32),
        takes_seed=False, elementwise=False,
    ),
]


def find(name: str) -> OptimizerInfo:
    """The entry of the qstate optimizer class named ``name``."""
    for info in optim_db:
        if info.name == name:
            return info
    raise KeyError(f"optim_db: no entry for optimizer {name!r}; entries: {[info.name for info in optim_db]}")

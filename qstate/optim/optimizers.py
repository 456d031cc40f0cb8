"""``AdamW``, ``Adam``, ``Lion``, ``SGD``: :class:`QuantizedOptimizer` plus arguments and flags.

Common keyword-only arguments (see ``_base.py`` for the policy):

* ``state_format``: ``"8bit"``, ``"4bit"``, ``"fp8"`` (quantized states,
  :class:`~qstate.QuantizedState`), ``"bf16"`` or ``"fp32"`` (plain states);
* ``block_size``: quantization block size (default: the format's);
* ``state_rounding`` (None): how new values are rounded into the *signed*
  quantized states (first moments, momentum buffers): ``"nearest"`` or
  ``"stochastic"`` (unbiased, a deterministic function of each value; the
  map formats ``8bit``/``4bit`` implement it). None: stochastic for ``4bit``
  (whose round-to-nearest stalls small EMA increments), nearest otherwise.
  Unsigned states (second moments) always round to nearest. Each state keeps
  its rounding (``QuantizedState.rounding``); loading a checkpoint whose
  states round otherwise raises;
* ``min_quantize_numel`` (4096): parameters with fewer elements keep float32
  states;
* ``bf16_stochastic_round``: write bfloat16 parameters with unbiased
  stochastic rounding (the optimizer's own, saved, random stream);
* ``compile`` (True): fused compiled kernels for plain tensors and plain
  quantized states (one graph per kernel kind); ``False`` runs the same math
  eagerly op by op (the path DTensor states always take);
* ``seed``: seed of the stochastic-rounding stream (default: drawn from the
  global generator at construction and, when ``torch.distributed`` runs more
  than one rank, replaced by rank 0's at the first step that rounds, so every
  rank draws the same stream);
* ``skip_nonfinite`` (False): skip a step whose gradients hold an inf or a
  NaN on any rank, leaving parameters, states and step counts bit-identical
  (torch's AMP ``found_inf`` protocol; a ``GradScaler``'s ``found_inf`` is
  used as it is, otherwise the step checks the gradients:
  :func:`qstate.amp.found_non_finite`). Optimizer-wide: a step is taken or
  skipped as a whole. With the default the gradient is applied as it is: an
  inf or NaN makes that element's update non-finite, as in ``torch.optim``,
  and in a quantized state the whole block of each state it reaches (its
  finite values decode as NaN; ``qstate/formats/_base.py``), so the
  parameter elements those blocks update.

torch.optim's implementation arguments (``fused``, ``foreach``, ``capturable``,
``differentiable``; Adam, AdamW and SGD take exactly their namesake's, Lion all
four) are accepted where qstate can honour them, and stored in the param groups
as torch stores them: qstate always runs its own fused update, outside autograd
and CUDA graphs, so ``fused`` may be None or True, ``foreach`` None or False,
``capturable`` and ``differentiable`` False; other values raise a
``ValueError`` naming the argument (:func:`_check_implementation`).
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

from torch import Tensor

from ._base import QuantizedOptimizer
from ._rules import RULES

__all__ = ["AdamW", "Adam", "Lion", "SGD"]

_LR = Union[float, Tensor]


def _check_lr(name: str, lr) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{name}: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        return
    if not 0.0 <= lr:
        raise ValueError(f"{name}: invalid learning rate: {lr}")


def _check_betas(name: str, betas) -> None:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: invalid betas {tuple(betas)}: expected two values in [0, 1)")


def _check_non_negative(name: str, what: str, value: float) -> None:
    if not 0.0 <= value:
        raise ValueError(f"{name}: invalid {what}: {value}")


#: torch.optim's implementation arguments: the values qstate honours, and why it honours no others
_IMPLEMENTATION = {
    "foreach": ((None, False), "qstate always runs its own fused update, never torch's foreach implementation"),
    "fused": ((None, True), "qstate always runs its own fused update"),
    "capturable": ((False,), "qstate's step reads its step counts (CPU tensors) and scalars on the host, which a "
                             "CUDA graph cannot capture"),
    "differentiable": ((False,), "qstate's update runs without autograd and writes quantized states in place"),
}

#: the names of torch.optim's implementation arguments
IMPLEMENTATION_OPTIONS = tuple(_IMPLEMENTATION)


def _check_implementation(name: str, group: dict) -> None:
    """Raise a ``ValueError`` unless ``group``'s torch.optim implementation arguments (those it has
    of ``fused``, ``foreach``, ``capturable``, ``differentiable``) are values qstate honours.

    Invariant: an accepted group runs exactly as it would with every such argument left at its
    default, so the values only record what the caller asked for.
    """
    if group.get("fused") and group.get("foreach"):  # torch.optim's own rule comes first
        raise ValueError(f"{name}: fused=True and foreach=True cannot both be set; got fused="
                         f"{group['fused']!r}, foreach={group['foreach']!r}")
    for arg, (accepted, why) in _IMPLEMENTATION.items():
        value = group.get(arg)
        if arg in group and not ((value is None or isinstance(value, bool)) and value in accepted):
            expected = " or ".join(repr(a) for a in accepted)
            raise ValueError(f"{name}: {arg} must be {expected}, got {group[arg]!r}: {why}")


class Adam(QuantizedOptimizer):
    """Adam with quantized moments (``torch.optim.Adam`` arguments and semantics)."""

    rule = RULES["adam"]
    _decoupled_default = False

    def __init__(self, params: Iterable, lr: _LR = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 decoupled_weight_decay: Optional[bool] = None, state_format: str = "8bit",
                 block_size: Optional[int] = None, min_quantize_numel: int = 4096,
                 bf16_stochastic_round: bool = False, compile: bool = True, seed: Optional[int] = None,
                 state_rounding: Optional[str] = None, skip_nonfinite: bool = False):
        decoupled = self._decoupled_default if decoupled_weight_decay is None else decoupled_weight_decay
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=decoupled)
        super().__init__(params, defaults, state_format=state_format, block_size=block_size,
                         min_quantize_numel=min_quantize_numel, bf16_stochastic_round=bf16_stochastic_round,
                         compile=compile, seed=seed, state_rounding=state_rounding,
                         skip_nonfinite=skip_nonfinite)

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        _check_lr(name, group["lr"])
        _check_betas(name, group["betas"])
        _check_non_negative(name, "epsilon value", group["eps"])
        _check_non_negative(name, "weight_decay value", group["weight_decay"])
        _check_implementation(name, group)

    def _flags(self, group: dict) -> dict:
        return {"amsgrad": bool(group["amsgrad"]), "maximize": bool(group["maximize"]),
                "decoupled": bool(group["decoupled_weight_decay"])}


class AdamW(Adam):
    """AdamW with quantized moments (``torch.optim.AdamW`` arguments and semantics)."""

    _decoupled_default = True

    def __init__(self, params: Iterable, lr: _LR = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, state_format: str = "8bit", block_size: Optional[int] = None,
                 min_quantize_numel: int = 4096, bf16_stochastic_round: bool = False, compile: bool = True,
                 seed: Optional[int] = None, state_rounding: Optional[str] = None,
                 skip_nonfinite: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, state_format=state_format, block_size=block_size,
                         min_quantize_numel=min_quantize_numel, bf16_stochastic_round=bf16_stochastic_round,
                         compile=compile, seed=seed, state_rounding=state_rounding,
                         skip_nonfinite=skip_nonfinite)


class Lion(QuantizedOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") with a quantized momentum."""

    rule = RULES["lion"]

    def __init__(self, params: Iterable, lr: _LR = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, foreach: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
                 state_format: str = "8bit", block_size: Optional[int] = None, min_quantize_numel: int = 4096,
                 bf16_stochastic_round: bool = False, compile: bool = True, seed: Optional[int] = None,
                 state_rounding: Optional[str] = None, skip_nonfinite: bool = False):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, state_format=state_format, block_size=block_size,
                         min_quantize_numel=min_quantize_numel, bf16_stochastic_round=bf16_stochastic_round,
                         compile=compile, seed=seed, state_rounding=state_rounding,
                         skip_nonfinite=skip_nonfinite)

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        _check_lr(name, group["lr"])
        _check_betas(name, group["betas"])
        _check_non_negative(name, "weight_decay value", group["weight_decay"])
        _check_implementation(name, group)

    def _flags(self, group: dict) -> dict:
        return {"maximize": bool(group["maximize"])}


class SGD(QuantizedOptimizer):
    """SGD with a quantized momentum buffer (``torch.optim.SGD`` arguments and semantics)."""

    rule = RULES["sgd"]

    def __init__(self, params: Iterable, lr: _LR = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False, fused: Optional[bool] = None,
                 state_format: str = "8bit", block_size: Optional[int] = None, min_quantize_numel: int = 4096,
                 bf16_stochastic_round: bool = False, compile: bool = True, seed: Optional[int] = None,
                 state_rounding: Optional[str] = None, skip_nonfinite: bool = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults, state_format=state_format, block_size=block_size,
                         min_quantize_numel=min_quantize_numel, bf16_stochastic_round=bf16_stochastic_round,
                         compile=compile, seed=seed, state_rounding=state_rounding,
                         skip_nonfinite=skip_nonfinite)

    def _check_group(self, group: dict) -> None:
        name = type(self).__name__
        _check_lr(name, group["lr"])
        _check_non_negative(name, "momentum value", group["momentum"])
        _check_non_negative(name, "weight_decay value", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{name}: nesterov momentum requires a momentum and zero dampening")
        _check_implementation(name, group)

    def _flags(self, group: dict) -> dict:
        return {"maximize": bool(group["maximize"]), "momentum": group["momentum"] != 0,
                "nesterov": bool(group["nesterov"])}

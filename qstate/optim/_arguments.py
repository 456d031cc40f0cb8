"""The arguments every qstate optimizer takes, and the checks of torch.optim's.

Common keyword-only arguments (see ``_base.py`` for the policy):

* ``state_format``: ``"8bit"``, ``"4bit"``, ``"fp8"`` (quantized states,
  :class:`~qstate.QuantizedState`), ``"bf16"`` or ``"fp32"`` (plain states);
* ``block_size``: quantization block size (default: the format's);
* ``state_rounding`` (None): how new values are rounded into the *signed*
  quantized states (first moments, momentum buffers): ``"nearest"`` or
  ``"stochastic"`` (unbiased; drawn by each element's place under a key per
  parameter and step, the same on every rank and path; the map formats
  ``8bit``/``4bit`` implement it). None: stochastic for ``4bit``
  (whose round-to-nearest stalls small EMA increments), nearest otherwise.
  Unsigned states (second moments) round stochastically in ``fp8`` (whose
  3 mantissa bits hold an EMA's 0.1% steps still under round-to-nearest;
  never to 0) and to nearest in the other formats, whatever this option
  says. Each state keeps
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

from typing import Union

from torch import Tensor

__all__ = ["IMPLEMENTATION_OPTIONS", "LR", "check_betas", "check_implementation", "check_lr", "check_non_negative"]

#: ``lr``: a Python float or a one-element tensor
LR = Union[float, Tensor]


def check_lr(name: str, lr) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{name}: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        return
    if not 0.0 <= lr:
        raise ValueError(f"{name}: invalid learning rate: {lr}")


def check_betas(name: str, betas) -> None:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: invalid betas {tuple(betas)}: expected two values in [0, 1)")


def check_non_negative(name: str, what: str, value: float) -> None:
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


def check_implementation(name: str, group: dict) -> None:
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

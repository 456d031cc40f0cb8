"""torch.optim's arguments every qstate optimizer shares (``lr``, the implementation arguments) and their checks.

The state policy's keyword arguments (``state_format``, ``block_size``, ``min_quantize_numel``,
``bf16_stochastic_round``, ``compile``, ``seed``, ``state_rounding``, ``skip_nonfinite``), which every
optimizer takes, are :class:`~qstate.optim.StatePolicy`'s: its docstring documents them.

torch.optim's implementation arguments (``fused``, ``foreach``, ``capturable``,
``differentiable``; Adam, AdamW and SGD take exactly their namesake's, Lion and
AdEMAMix all four) are stored in the param groups as torch stores them, and
``fused``/``foreach`` choose each group's update path as they choose torch's
(:func:`qstate.optim._engine.path.group_path`): the same math on three paths, as torch's fused, foreach
and for-loop implementations are one algorithm:

==============  ================  =================  =================================
``fused``       ``foreach=None``  ``foreach=False``  ``foreach=True``
==============  ================  =================  =================================
None (default)  fused             fused              foreach
True            fused             fused              ``RuntimeError`` (as torch's)
False           for-loop          for-loop           foreach
==============  ================  =================  =================================

* ``"fused"``: qstate's fused op, ``qstate::fused_update`` with its fused kernels
  (``compile=True``). ``compile=False`` turns the kernels off, so it asks for the
  for-loop path, and a group that says ``fused=True`` with ``compile=False`` raises a
  ``ValueError`` (:func:`check_path`);
* ``"foreach"``: the rule's math op by op over the list: one ``qstate::fused_update``
  call per step, device and mesh whose kernels run the math op by op on each
  parameter (or shard: DTensor runs the op on the local tensors), no compiled kernel;
* ``"for-loop"``: the rule's math op by op, tensor by tensor (DTensor dispatches each op).

foreach and for-loop give the same bits; the fused kernels the same values up to
floating-point contraction (FMA) and reassociation, which rounding can move by a code.
``capturable`` and ``differentiable`` may only be False: other values raise a
``ValueError`` naming the argument (:func:`check_implementation`).
"""

from __future__ import annotations

import numbers
from typing import Union

import torch
from torch import Tensor

__all__ = ["IMPLEMENTATION_OPTIONS", "LR", "check_betas", "check_implementation",
           "check_lr", "check_non_negative", "check_path"]

#: ``lr``: a Python float or a one-element tensor
LR = Union[float, Tensor]


def check_lr(name: str, lr) -> None:
    """torch.optim's checks of ``lr``: a real number, or a one-element real tensor (read once, here),
    whose value is ``>= 0`` (so not NaN). A tensor ``lr`` may require grad (it is read detached, as
    torch.optim reads it with ``differentiable=False``)."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{name}: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        if lr.is_complex() or lr.dtype == torch.bool:
            raise ValueError(f"{name}: a tensor lr must be real, got dtype {lr.dtype}")
        value = lr.detach().reshape(()).item()
    elif isinstance(lr, numbers.Real) and not isinstance(lr, bool):
        value = lr
    else:
        raise TypeError(f"{name}: lr must be a float or a one-element tensor, got {type(lr).__name__} {lr!r}")
    if not 0.0 <= value:
        raise ValueError(f"{name}: invalid learning rate: {value}")


def check_betas(name: str, betas) -> None:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: invalid betas {tuple(betas)}: expected two values in [0, 1)")


def check_non_negative(name: str, what: str, value: float) -> None:
    if not 0.0 <= value:
        raise ValueError(f"{name}: invalid {what}: {value}")


#: torch.optim's implementation arguments: the values qstate honours, and why it honours no others
_IMPLEMENTATION = {
    "foreach": ((None, False, True), ""),
    "fused": ((None, False, True), ""),
    "capturable": ((False,), ": qstate's step reads its step counts (CPU tensors) and scalars on the host, which a "
                             "CUDA graph cannot capture"),
    "differentiable": ((False,), ": qstate's update runs without autograd and writes quantized states in place"),
}

#: the names of torch.optim's implementation arguments
IMPLEMENTATION_OPTIONS = tuple(_IMPLEMENTATION)

#: the update paths (:func:`qstate.optim._engine.path.group_path`)


def check_implementation(name: str, group: dict) -> None:
    """Raise unless ``group``'s torch.optim implementation arguments (those it has of ``fused``,
    ``foreach``, ``capturable``, ``differentiable``) are values qstate honours: ``fused`` and
    ``foreach`` None or a bool, not both True (a ``RuntimeError``, as torch.optim raises), and
    ``capturable``/``differentiable`` False (a ``ValueError`` naming the argument)."""
    if group.get("fused") is True and group.get("foreach") is True:  # torch.optim's own rule
        raise RuntimeError(f"{name}: `fused` and `foreach` cannot be `True` together.")
    for arg, (accepted, why) in _IMPLEMENTATION.items():
        value = group.get(arg)
        if arg in group and not ((value is None or isinstance(value, bool)) and value in accepted):
            expected = " or ".join(filter(None, [", ".join(map(repr, accepted[:-1])), repr(accepted[-1])]))
            raise ValueError(f"{name}: {arg} must be {expected}, got {group[arg]!r}{why}")


def check_path(name: str, group: dict, compile: bool) -> None:
    """Raise a ``ValueError`` if ``group`` asks for the fused path (``fused=True``) that
    ``compile=False`` turns off: neither wins silently."""
    if group.get("fused") is True and not compile:
        raise ValueError(f"{name}: fused=True runs qstate's fused kernels, which compile=False turns off; pass "
                         f"compile=True (the default), or fused=False to run the update tensor by tensor")

"""Op-by-op updates of states through plain working values: :func:`update_states`.

Every in-place op on a quantized state decodes and re-encodes it, so an update written as
several ops (``m.mul_(b).add_(g)``) rounds the state once per op; :func:`update_states` gives
such code one decode and one encode per state per update.

Storage rules:

* A quantized state (a :class:`~qstate.QuantizedState`, a view of one, or a DTensor over either)
  is read into a plain tensor of ``dtype`` (a DTensor of the same mesh,
  placements and shape for a DTensor state, with no communication) and written
  back with ``state.copy_(values)`` when the block exits normally: the state's
  own format, block size and rounding, exactly as a user's ``copy_`` would.
* Any other tensor is handed out as it is: the ops write it directly.
* Nothing is written when the block raises, and before the first write-back
  every working tensor is checked to still have its state's shape, ``dtype``
  and device, so a failing check leaves every state unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor

from ._api import dequantize
from ._dtensor import is_quantized_state, shard_of
from ._state_view import QuantizedStateView

__all__ = ["update_states"]


@contextlib.contextmanager
def update_states(states: Sequence[Tensor], dtype: torch.dtype = torch.float32) -> Iterator[list[Tensor]]:
    """Update ``states`` in place through plain tensors, writing each quantized state back once.

    Yields one tensor per state, in order: for a quantized state (plain or DTensor)
    a plain working copy of its values in ``dtype``; for any other tensor the
    tensor itself. Write the new values into the yielded tensors in place;
    when the block exits normally each quantized state is encoded once from its
    working copy. If the block raises, no state is written.

    Example (Adam's moments, written op by op)::

        with qstate.update_states([exp_avg, exp_avg_sq]) as (m, v):
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    """
    if isinstance(states, Tensor):
        raise TypeError(f"update_states: expected a sequence of tensors, got a single tensor of shape "
                        f"{tuple(states.shape)}; pass [state]")
    states = list(states)
    for i, s in enumerate(states):
        if not isinstance(s, Tensor):
            raise TypeError(f"update_states: expected a sequence of tensors, got {type(s).__name__} at index {i}")
    if not dtype.is_floating_point:
        raise TypeError(f"update_states: expected a floating-point dtype for the working values, got {dtype}")
    quantized = [is_quantized_state(s) or isinstance(shard_of(s), QuantizedStateView) for s in states]
    work = [dequantize(s, dtype) if q else s for s, q in zip(states, quantized)]
    yield list(work)
    for i, (s, w, q) in enumerate(zip(states, work, quantized)):
        if q and (tuple(w.shape) != tuple(s.shape) or w.dtype != dtype or w.device != s.device):
            raise ValueError(
                f"update_states: the working values of state {i} must keep shape {tuple(s.shape)}, dtype "
                f"{dtype} and device {s.device}, got shape {tuple(w.shape)}, dtype {w.dtype}, device "
                f"{w.device}; no state was written"
            )
    for s, w, q in zip(states, work, quantized):
        if q:
            s.copy_(w)

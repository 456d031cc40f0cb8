"""``torch.distributed.checkpoint`` loading that validates before it writes.

``dcp.load`` copies each stored piece into the destination as it reads it, and
a copy converts: a stored :class:`~qstate.QuantizedState` copied into a plain
tensor is dequantized, a stored plain tensor copied into a ``QuantizedState``
is encoded, so a checkpoint of another format would load silently (or, for
two quantized kinds, fail half way with some states already overwritten).
:func:`load` reads into a staging copy of the destination first, checks what
the checkpoint *stored* against each destination as it reads it, then checks
the optimizer policy options of qstate's param groups, and copies into the
live tensors only when everything loaded and matched. It costs one extra copy
of the states while loading.

Invariant: when :func:`load` raises, no tensor and no value of its
``state_dict`` has changed. So the flow ``sd = get_optimizer_state_dict(model,
opt)``, ``load({"optim": sd}, ...)``, ``set_optimizer_state_dict(model, opt,
sd)``, whose ``sd`` aliases the optimizer's live states, never leaves the
optimizer half loaded. A checkpoint of another state policy loads into an
optimizer of the checkpoint's policy, and :func:`qstate.optim.convert_state_dict`
then converts its state dict.

Saving needs nothing special: ``dcp.save`` stores quantized DTensor states
shard by shard, and loading at another world size moves whole rows (see
:mod:`qstate.distributed`), so it is exact for ``ndim >= 2`` states.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.utils._pytree import tree_map_only

from ._dtensor import state_kind
from ._state import QuantizedState

__all__ = ["load", "NamingLoadPlanner"]

_aten = torch.ops.aten


class _CheckedTarget(torch.Tensor):
    """A staging destination that checks what a storage reader copies into it.

    Readers copy each stored piece into the tensor the planner resolves
    (``target.detach().copy_(stored)``). This wrapper raises unless the stored
    piece has the destination's kind (:func:`qstate.distributed.state_kind`:
    format, signedness, block size, rounding; or plain), then copies; every
    other op runs on the wrapped tensor.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, key: str):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                device=inner.device, requires_grad=False)
        t.inner, t.key = inner, key
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"_CheckedTarget({self.key!r}, {self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.copy_.default and isinstance(args[0], cls):
            dst, src = args
            expected, found = state_kind(dst.inner), state_kind(src)
            quantized = isinstance(dst.inner, QuantizedState) or isinstance(src, QuantizedState)
            if quantized and expected != found:
                raise ValueError(f"{dst.key!r}: expected a {expected} state (the destination's), the checkpoint "
                                 f"stores a {found} state; loading never converts states")
            dst.inner.copy_(src)
            return dst
        if func is _aten.detach.default and isinstance(args[0], cls):
            return cls(args[0].inner, args[0].key)
        args, kwargs = tree_map_only(cls, lambda t: t.inner, (args, kwargs))
        return func(*args, **kwargs)


class NamingLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that names each quantized destination after its key, and (with
    ``check_stored_kinds``) resolves each destination to a wrapper that raises unless what the
    checkpoint stored there is a state of the destination's kind (quantized or plain)."""

    def __init__(self, *args: Any, check_stored_kinds: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.check_stored_kinds = check_stored_kinds

    def resolve_tensor(self, read_item):
        tensor = super().resolve_tensor(read_item)
        if isinstance(tensor, QuantizedState):
            tensor.state_name = read_item.dest_index.fqn
        if self.check_stored_kinds:
            return _CheckedTarget(tensor, read_item.dest_index.fqn)
        return tensor


def load(state_dict: dict[str, Any], *, checkpoint_id: Any = None, storage_reader: Any = None,
         process_group: Optional[Any] = None) -> None:
    """``dcp.load`` into ``state_dict`` in place, all or nothing.

    Raises ``ValueError`` and leaves every tensor and value of ``state_dict``
    unchanged when the checkpoint stores a state of another kind than its
    destination (a quantized state for a plain one or the reverse, another
    format, block size, signedness or rounding: naming the key, the expected
    and the found), when a param group of a qstate optimizer
    (``get_optimizer_state_dict``) has policy options (``state_format``,
    ``block_size``, ``state_rounding``, ``min_quantize_numel``) other than the
    destination's, or when ``dcp.load`` fails otherwise (a missing key, a
    shape). Plain tensors that are not optimizer states load as ``dcp.load``
    loads them.
    """
    staging = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state_dict)
    try:
        dcp.load(staging, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                 planner=NamingLoadPlanner(check_stored_kinds=True), process_group=process_group)
    except CheckpointException as e:
        first = next(iter(e.failures.values()))[0]
        raise ValueError(f"checkpoint not loaded, states unchanged: {first}") from None
    _check_policy_options(state_dict, staging, "")
    _copy_tree(state_dict, staging)


def _check_policy_options(dst: Any, src: Any, path: str) -> None:
    """Raise unless every qstate param group in ``dst`` (a dict with a ``state_format``) has the
    policy options of its loaded copy ``src``: loading never changes an optimizer's state policy."""
    from .optim._base import POLICY_OPTIONS

    if isinstance(dst, dict):
        if "state_format" in dst and isinstance(src, dict):
            for option in POLICY_OPTIONS:
                if option in dst and option in src and src[option] != dst[option]:
                    raise ValueError(f"checkpoint not loaded, states unchanged: {path}{option}: expected "
                                     f"{dst[option]!r} (the optimizer's), the checkpoint has {src[option]!r}; "
                                     "loading never converts states (see qstate.optim.convert_state_dict)")
        items = [(k, v, src.get(k) if isinstance(src, dict) else None) for k, v in dst.items()]
    elif isinstance(dst, (list, tuple)) and isinstance(src, (list, tuple)):
        items = list(zip(range(len(dst)), dst, src))
    else:
        return
    for key, d, s in items:
        _check_policy_options(d, s, f"{path}{key}.")


def _copy_tree(dst: Any, src: Any) -> None:
    for key, value in src.items():
        if isinstance(value, torch.Tensor):
            dst[key].detach().copy_(value)
        elif isinstance(value, dict):
            _copy_tree(dst[key], value)
        else:
            dst[key] = value

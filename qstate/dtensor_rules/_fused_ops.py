"""``qstate::fused_update`` on DTensors: the update is elementwise, so it runs shard by shard.

Algebra: an elementwise update of each ``param`` from its ``grad`` and ``states`` with
replicated scalars commutes with any ``Shard``/``Replicate`` layout that all of
them share: the update of a shard is the shard of the update. ``Partial``
inputs (the sum of the shards is not a shard of the sum) and differing layouts
would need communication; the rule rejects them instead (:class:`LayoutMismatch`,
before any tensor is written), so the step issues zero collectives. ``hyper`` is
a plain (replicated) tensor, or its values as Python floats where the optimizers
call the handler themselves (:func:`call_fused_update`).

The optimizers reach the handler without DTensor's dispatcher where nothing
could intercept the op (:func:`handler_is_reached`), and on later steps run a
shard's prepared call (C or inductor kernel) where the handler would run exactly that
(:func:`shards_of`); under any dispatch or function mode they call the op.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from qstate._library import fused_update, hyper_tensor, states_per_param
from qstate.distributed import _dtensor_type, _quantized_state_type
from qstate.dtensor_rules._registry import Rule

__all__ = ["QSTATE_OP_RULES", "LayoutMismatch", "call_fused_update", "flat_start", "fused_update_handler",
           "layout_mismatch", "shards_of"]


class LayoutMismatch(ValueError):
    """``qstate::fused_update`` cannot run these DTensors shard by shard: their shapes, meshes or
    placements differ, or a placement is ``Partial``. Raised before any tensor is written (the
    optimizers then run those parameters' math op by op)."""


def layout_mismatch(param, grad, states) -> Optional[Exception]:
    """Why this rule cannot run the update of ``param`` shard by shard (``None``: it can).

    It can when ``param``, ``grad`` and every state are DTensors of one shape, mesh and
    placements, none of them ``Partial``.
    """
    DTensor = _dtensor_type()
    # checked every step: DTensor specs read once per tensor (``device_mesh``/``placements`` are
    # properties over them; the spec's global shape is a plain attribute, the tensor's a sizes
    # call), identity settles most compares, names are built only for an error
    tensors = (param, grad, *states)
    for i, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            return TypeError(f"{_name(i)} is a {type(t).__name__}, expected a DTensor")
    spec = param._spec
    for i, t in enumerate(tensors[1:], 1):
        other = t._spec
        if not _same_layout(spec, other):
            return LayoutMismatch(
                f"{_name(i)} must match param (shape {tuple(spec.shape)}, placements {spec.placements} on "
                f"{spec.mesh}), got shape {tuple(t.shape)}, placements {other.placements} on {other.mesh}"
            )
    if _has_partial(spec):
        return LayoutMismatch(f"Partial placements {spec.placements} are not shards of the update; redistribute first")
    return None


def _same_layout(spec, other) -> bool:
    """Whether two DTensor specs have one global shape, mesh and placements. Asked every step:
    identity settles most compares (FSDP2 builds a parameter's sharded gradient on the
    parameter's own spec), and the spec's global shape is a plain attribute (the tensor's is a
    sizes call)."""
    if other is spec:
        return True
    mesh, placements = spec.mesh, spec.placements
    return ((other.mesh is mesh or other.mesh == mesh)
            and (other.placements is placements or other.placements == placements)
            and other.shape == spec.shape)


def _has_partial(spec) -> bool:
    return any(pl.is_partial() for pl in spec.placements)


def _name(i: int) -> str:
    """The argument name of tensor ``i`` of ``(param, grad, *states)``."""
    return "param" if i == 0 else "grad" if i == 1 else f"states[{i - 2}]"


def fused_update_handler(op_call, args: tuple, kwargs: dict) -> None:
    params, grads, states, hyper, kind, *rest = args
    sr_keys = rest[0] if rest else kwargs.get("sr_keys")
    n = states_per_param(params, grads, states)
    for i, (param, grad) in enumerate(zip(params, grads)):
        error = layout_mismatch(param, grad, states[i * n:(i + 1) * n])
        if error is not None:
            raise type(error)(f"qstate::fused_update on DTensors: params[{i}]: {error}")
    extra = {}
    if sr_keys is not None:  # stochastic rounding draws by each element's place in the full parameter
        starts = [flat_start(p) for p in params]
        for i, start in enumerate(starts):
            if start is None:
                raise LayoutMismatch(f"qstate::fused_update on DTensors with sr_keys: params[{i}]: placements "
                                     f"{params[i].placements} do not keep each shard one range of the flat parameter "
                                     f"(Shard(0) and Replicate do)")
        extra = {"sr_keys": sr_keys, "starts": starts}
    local = ([p._local_tensor for p in params], [g._local_tensor for g in grads], [s._local_tensor for s in states])
    if _reaches_shard_kernel(local):
        _shard_kernel()(*local, hyper, kind, **extra)
    else:
        op_call(*local, hyper_tensor(hyper), kind, **extra)


def flat_start(param) -> Optional[int]:
    """The flat (row-major) index in the full tensor of the first element of this rank's shard of the DTensor
    ``param``, where the shard is one contiguous range of that order (every placement ``Replicate`` or
    ``Shard(0)``, even or uneven), else ``None``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard

    spec = param._spec
    # exactly Shard (a _StridedShard's rows interleave with other ranks')
    if not all(pl.is_replicate() or (type(pl) is Shard and pl.dim == 0) for pl in spec.placements):
        return None
    shape = tuple(spec.shape)
    _, offset = compute_local_shape_and_global_offset(shape, spec.mesh, spec.placements)
    row = 1
    for size in shape[1:]:
        row *= size
    return offset[0] * row if shape else 0


def call_fused_update(params, grads, states, hyper, kind: str, sr_keys: Optional[list[int]] = None) -> None:
    """``qstate::fused_update(params, grads, states, hyper, kind, sr_keys)`` on DTensors, as the optimizers call it.

    DTensor's dispatcher answers the op by calling :func:`fused_update_handler` (this module's
    rule). Where nothing else could see the call (:func:`handler_is_reached` and every tensor
    exactly a ``DTensor``), this calls the handler directly and saves the dispatcher's hop, about
    0.06 ms a step with cold caches (``benchmarks/bench_dtensor_step.py``); otherwise it calls the
    op. The same handler runs either way, with the same checks and errors.

    ``hyper``: the op's scalar vector, or on the CPU its values as Python floats, which the shards'
    C kernel reads as they are (:func:`qstate._library.hyper_tensor` makes the tensor where one is
    needed).
    """
    extra = {} if sr_keys is None else {"sr_keys": sr_keys}
    if handler_is_reached() and _all_dtensors(params, grads, states):
        fused_update_handler(fused_update, (params, grads, states, hyper, kind), extra)
    else:
        fused_update(params, grads, states, hyper_tensor(hyper), kind, **extra)


def handler_is_reached() -> bool:
    """Whether DTensor's dispatcher would hand ``qstate::fused_update`` on ``DTensor`` inputs to
    :func:`fused_update_handler` with nothing able to intercept it: no dispatch or function mode is
    active (``CommDebugMode``, ``FakeTensorMode``, ...), nothing is being compiled, and the handler
    registered for the op is this one (``import qstate`` registers it). A
    property of the moment, not of the tensors: asked once per step."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch.compiler.is_compiling():
        return False
    return _dtensor_type()._op_dispatcher._custom_op_handlers.get(fused_update) is fused_update_handler


def _all_dtensors(*lists) -> bool:
    """Whether every tensor is exactly a ``DTensor`` (a subclass may dispatch otherwise)."""
    DTensor = _dtensor_type()
    return all(type(t) is DTensor for tensors in lists for t in tensors)


def shards_of(param, grad, states) -> Optional[tuple]:
    """``(param, grad, states)``'s local shards, if :func:`call_fused_update` of this one update would
    run the op's shard kernel on exactly them, else ``None``. The caller has checked
    :func:`handler_is_reached` (once per step); then it would when every tensor is exactly a
    ``DTensor``, the layouts match (as :func:`layout_mismatch` checks) and the shards reach the
    shard kernel (:func:`_reaches_shard_kernel`).

    Lets a caller that holds the shard kernel's prepared work for these shards run it without the
    op (``qstate.optim._fused_op.prepared_shard_call``); it must then do exactly what the shard
    kernel would.
    """
    DTensor = _dtensor_type()
    if type(param) is not DTensor or type(grad) is not DTensor:
        return None
    spec = param._spec
    if not _same_layout(spec, grad._spec):
        return None
    for s in states:
        if type(s) is not DTensor or not _same_layout(spec, s._spec):
            return None
    if _has_partial(spec):
        return None
    local = ((param._local_tensor,), (grad._local_tensor,), [s._local_tensor for s in states])
    if not _local_types_reach_shard_kernel(local):
        return None
    return local[0][0], local[1][0], local[2]


@functools.cache
def _shard_kernel() -> Callable:
    """The op's kernel on the local shards, ``qstate.optim._fused_op.update_shards`` (imported on first
    use: this package never imports the optimizers at import time)."""
    from qstate.optim._fused_op import update_shards

    return update_shards


def _reaches_shard_kernel(local: tuple) -> bool:
    """Whether re-dispatching the op on these local tensors would only call :func:`_shard_kernel`:
    no dispatch mode is active (``LocalTensorMode``, fake tensors, ...) and every tensor is a plain
    tensor (the op's ``CompositeExplicitAutograd`` kernel) or a ``QuantizedState`` (whose op table
    calls the same function). Calling it directly saves the second dispatch, about 0.01 ms a step."""
    return not torch._C._len_torch_dispatch_stack() and _local_types_reach_shard_kernel(local)


def _local_types_reach_shard_kernel(local: tuple) -> bool:
    direct = (torch.Tensor, torch.nn.Parameter, _quantized_state_type())
    return all(type(t) in direct for tensors in local for t in tensors)


#: qstate's own op (registered by ``import qstate``)
QSTATE_OP_RULES: tuple[Rule, ...] = (
    Rule(
        op=fused_update,
        kind="handler",
        impl=fused_update_handler,
        reason="qstate's own fused optimizer update: shard by shard, same layouts only, no collectives",
    ),
)

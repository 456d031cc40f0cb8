"""``qstate::fused_update`` on DTensors: the update is elementwise, so it runs shard by shard.

Algebra: an elementwise update of each ``param`` from its ``grad`` and ``states`` with
replicated scalars commutes with any ``Shard``/``Replicate`` layout that all of
them share: the update of a shard is the shard of the update. ``Partial``
inputs (the sum of the shards is not a shard of the sum) and differing layouts
would need communication; the rule rejects them instead (:class:`LayoutMismatch`,
before any tensor is written), so the step issues zero collectives. ``hyper`` is
a plain (replicated) tensor.

With ``sr_keys`` (stochastic rounding), each element's draw follows its place in the full
parameter: the rule passes each shard's flat offset (``starts``) to the shards' op, which needs
every shard to be one range of the flat parameter on one rank (``Shard(0)``/``Replicate``, a
real rank's shard; a simulated rank's ``LocalTensor`` holds several ranks' shards at once).

The rule is a handler in DTensor's table (:data:`QSTATE_OP_RULES`): it checks the layouts,
then calls the op on the local shards, where the dispatcher reaches the op's kernels.
"""

from __future__ import annotations

from typing import Optional

from qstate._library import fused_update, states_per_param
from qstate.distributed import _dtensor_type
from qstate.dtensor_rules import _compat
from qstate.dtensor_rules._registry import Rule

__all__ = ["QSTATE_OP_RULES", "LayoutMismatch", "flat_start", "fused_update_handler", "layout_mismatch",
           "update_mismatch"]


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


def update_mismatch(param, grad, states, stochastic_round: bool) -> Optional[Exception]:
    """Why this rule cannot run one parameter's update shard by shard (``None``: it can):
    :func:`layout_mismatch`, and with stochastic rounding (``sr_keys``) a shard that is not one
    range of the flat parameter on one rank (:func:`flat_start`; not a simulated rank's
    ``LocalTensor``)."""
    error = layout_mismatch(param, grad, states)
    if error is not None or not stochastic_round:
        return error
    if flat_start(param) is None:
        return LayoutMismatch(f"placements {param.placements} do not keep each shard one range of the flat "
                              f"parameter (Shard(0) and Replicate do)")
    if _compat.is_local_tensor(param._local_tensor):
        return LayoutMismatch("the shards are simulated ranks' (LocalTensor): each rank's place in the flat "
                              "parameter is a different argument")
    return None


def fused_update_handler(op_call, args: tuple, kwargs: dict) -> None:
    params, grads, states, hyper, kind, *rest = args
    sr_keys = rest[0] if rest else kwargs.get("sr_keys")
    n = states_per_param(params, grads, states)
    for i, (param, grad) in enumerate(zip(params, grads)):
        error = update_mismatch(param, grad, states[i * n:(i + 1) * n], sr_keys is not None)
        if error is not None:
            raise type(error)(f"qstate::fused_update on DTensors{' with sr_keys' if sr_keys is not None else ''}: "
                              f"params[{i}]: {error}")
    extra = {} if sr_keys is None else {"sr_keys": sr_keys, "starts": [flat_start(p) for p in params]}
    op_call([p._local_tensor for p in params], [g._local_tensor for g in grads], [s._local_tensor for s in states],
            hyper, kind, **extra)


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


#: qstate's own op (registered by ``import qstate``)
QSTATE_OP_RULES: tuple[Rule, ...] = (
    Rule(
        op=fused_update,
        kind="handler",
        impl=fused_update_handler,
        reason="qstate's own fused optimizer update: shard by shard, same layouts only, no collectives",
    ),
)

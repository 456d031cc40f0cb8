"""Feature checks: does this torch's own DTensor rule already give the fixed result?

:func:`qstate.dtensor_rules.install` asks each opt-in rule's ``needed`` check before it writes the
rule, so on a torch that already has a fix nothing is installed for it.  The checks run DTensor's
sharding propagation (metadata only: no tensors, no collectives, no process group) on a 2-rank CPU
mesh built without a backend, and look at the decision torch makes for the case the rule fixes.

Invariant: a check never changes DTensor's tables or caches. A check that cannot run on this torch
(propagation API or mesh constructor missing) raises, naming itself: ``install()`` asks every check
before it writes anything, so it then raises with the tables unchanged rather than guess. (A
propagation that raises for the case a rule fixes is an answer, not a failure: :func:`propagate`
returns the exception for the check to read.)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Partial, Placement

from qstate.dtensor_rules import _compat


__all__ = ["checked", "has_rule", "keeps_partial", "mesh", "output_placements", "propagate", "schema_info", "spec"]

#: ranks of the mesh the checks propagate on
WORLD_SIZE = 2


@functools.lru_cache(maxsize=1)
def mesh() -> Any:
    """A 1-D CPU ``DeviceMesh`` of :data:`WORLD_SIZE` ranks that needs no process group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(WORLD_SIZE), _init_backend=False, _rank=0)


def spec(shape: Sequence[int], dtype: torch.dtype, placements: Sequence[Placement]) -> DTensorSpec:
    """The spec of a contiguous global ``shape`` / ``dtype`` tensor on :func:`mesh`."""
    strides = torch.empty(tuple(shape), device="meta").stride()
    return DTensorSpec(mesh(), tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), strides, dtype))


def has_rule(op: torch._ops.OpOverload) -> bool:
    """Whether torch has a sharding rule for ``op`` in any of its tables."""
    prop = _compat.propagator()
    return any(op in getattr(prop, table, {}) for table in
               ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules"))


def propagate(op: torch._ops.OpOverload, args: tuple, kwargs: Optional[dict] = None) -> Any:
    """torch's sharding decision for ``op`` on these specs (an ``OutputSharding``), or the exception
    its propagation raises (torch has no rule for these inputs, or refuses them)."""
    schema = OpSchema(op, args, kwargs or {})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _compat.propagator().propagate_op_sharding_non_cached(schema)
    except Exception as e:  # noqa: BLE001 - an answer: torch raises for this case
        return e


def output_placements(op: torch._ops.OpOverload, args: tuple, kwargs: Optional[dict] = None
                      ) -> Optional[tuple[Placement, ...]]:
    """The placements torch's rule gives ``op``'s (first) output, or None if its propagation raises."""
    out = propagate(op, args, kwargs)
    if isinstance(out, Exception):
        return None
    output_spec = out.output_spec
    if isinstance(output_spec, Sequence):
        output_spec = output_spec[0]
    return None if output_spec is None else tuple(output_spec.placements)


def keeps_partial(op: torch._ops.OpOverload, args: tuple, kwargs: Optional[dict] = None) -> bool:
    """Whether torch's rule gives ``op``'s output a ``Partial`` placement for these inputs (False
    where torch reduces first or raises)."""
    placements = output_placements(op, args, kwargs)
    return placements is not None and any(isinstance(p, Partial) for p in placements)


def schema_info(op: torch._ops.OpOverload) -> Any:
    """The ``RuntimeSchemaInfo`` torch's rule for ``op`` keys its sharding cache with (None: none)."""
    prop = _compat.propagator()
    return (prop.op_to_schema_info_for_single_dim_strategy.get(op)
            if op in getattr(prop, "op_single_dim_strategy_funcs", {}) else prop.op_to_schema_info.get(op))


def checked(check: Any) -> Any:
    """Wrap a ``needed`` check: a check that cannot run on this torch raises ``RuntimeError`` naming
    it and the cause (never a guess either way)."""

    @functools.wraps(check)
    def needed() -> bool:
        try:
            return bool(check())
        except Exception as e:
            name = getattr(check, "__qualname__", repr(check))
            raise RuntimeError(f"qstate.dtensor_rules: the feature check {name} cannot run on torch "
                               f"{torch.__version__} ({type(e).__name__}: {e}); nothing installed") from e

    return needed

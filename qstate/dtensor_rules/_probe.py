"""Feature checks: does this torch's own DTensor rule already give the fixed result?

:func:`qstate.dtensor_rules.install` asks each opt-in rule's ``needed`` check before it writes the
rule, so on a torch that already has a fix nothing is installed for it.  The checks run DTensor's
sharding propagation (metadata only: no tensors, no collectives, no process group) on a 2-rank CPU
mesh built without a backend, and look at the decision torch makes for the case the rule fixes.

Invariant: a check never changes DTensor's tables or caches. A check that cannot run on this torch
(propagation API or mesh constructor missing) raises, naming itself: ``install()`` asks every check
before it writes anything, so it then raises with the tables unchanged rather than guess. (A
propagation that raises for the case a rule fixes is an answer, not a failure: torch lacks the rule,
:func:`output_placements`.)
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


__all__ = ["checked", "has_partial", "has_rule", "mesh", "output_placements", "spec"]

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


def output_placements(op: torch._ops.OpOverload, args: tuple, kwargs: Optional[dict] = None
                      ) -> Optional[tuple[Placement, ...]]:
    """The placements torch's rule gives ``op``'s (first) output, or None if it has no rule for
    these inputs (propagation raises)."""
    schema = OpSchema(op, args, kwargs or {})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = _compat.propagator().propagate_op_sharding_non_cached(schema)
    except Exception:  # noqa: BLE001 - no rule for this case: the fix is needed
        return None
    output_spec = out.output_spec
    if isinstance(output_spec, Sequence):
        output_spec = output_spec[0]
    return None if output_spec is None else tuple(output_spec.placements)


def has_partial(placements: Optional[tuple[Placement, ...]]) -> bool:
    """True when ``placements`` is None (no rule) or keeps a ``Partial``."""
    return placements is None or any(isinstance(p, Partial) for p in placements)


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

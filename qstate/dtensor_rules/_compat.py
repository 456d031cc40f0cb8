"""Version gates and handles on DTensor's dispatch tables.

Everything in this package that touches a private DTensor structure gets it
from here, so a torch upgrade has one place to adjust.  Importing this module
has no side effects.

Invariant: every accessor returns the *live* object DTensor dispatches with
(never a copy), so writes through it are seen by the next DTensor op once the
sharding-propagation caches are cleared (:func:`clear_sharding_caches`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.torch_version import TorchVersion


__all__ = [
    "TORCH_VERSION",
    "clear_sharding_caches",
    "cpu_rng_states",
    "dispatch_as_torch",
    "dispatcher",
    "propagator",
    "local_tensor_mode_disabled",
    "run_per_rank",
]

TORCH_VERSION = TorchVersion(torch.__version__)

def dispatcher() -> Any:
    """The process-wide ``OpDispatcher`` DTensor dispatches through."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher


def propagator() -> Any:
    """The process-wide ``ShardingPropagator`` (owner of the strategy tables)."""
    return dispatcher().sharding_propagator


def clear_sharding_caches() -> None:
    """Drop every cached sharding decision: Python LRU, C++ fast path, tensor meta.

    Must run after any strategy table changes; otherwise a cached
    ``OutputSharding`` computed by the previous rule keeps being served.
    """
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # torch < 2.5: Python cache only
        prop = propagator()
        cache = getattr(prop, "propagate_op_sharding", None)
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    else:
        _clear_sharding_prop_cache()
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    meta_cache = getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None)
    if hasattr(meta_cache, "cache_clear"):
        meta_cache.cache_clear()


@contextlib.contextmanager
def local_tensor_mode_disabled() -> Iterator[None]:
    """Run plain (single-rank) tensor code even under ``LocalTensorMode``."""
    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    except ImportError:  # no LocalTensor simulation in this torch
        yield
        return
    with maybe_disable_local_tensor_mode():
        yield


def run_per_rank(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``maybe_run_for_local_tensor``: call ``fn`` once per simulated rank.

    Outside ``LocalTensorMode`` this is ``fn`` itself (one real rank).
    """
    try:
        from torch.distributed._local_tensor import maybe_run_for_local_tensor
    except ImportError:
        return fn
    return maybe_run_for_local_tensor(fn)


def dispatch_as_torch(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` on DTensors through torch's own path from a ``_custom_op_handlers`` entry: the steps
    DTensor's dispatch takes for an op without a handler (propagation, redistribution, the local op,
    the output's wrapping)."""
    d = dispatcher()
    op_info = d.unwrap_to_op_info(op, args, kwargs)
    d.sharding_propagator.propagate(op_info)
    mesh = op_info.compute_mesh
    local = d._dispatch_get_local_results_slow_path(op, args, op_info)
    schema, sharding = op_info.schema, op_info.output_sharding
    inplace, out = schema.is_inplace_op(), schema.is_out_variant_op()
    if sharding.output_spec is not None and not (inplace or out):  # a new output: DTensor wraps it
        return d.wrap(local, sharding.output_spec)
    return d._dispatch_fast_path_python_tail(op, args, kwargs, mesh, sharding, local,
                                             mesh._is_current_rank_part_of_mesh(), inplace, out)


def cpu_rng_states() -> Any:
    """``get_rng_state``/``set_rng_state`` of the default CPU generator, per simulated rank under
    ``LocalTensorMode`` (a ``LocalTensor`` of states), else the ``torch`` module's own."""
    try:
        from torch.distributed._local_tensor import _LocalDeviceHandle, enabled_local_tensor_mode
    except ImportError:  # no LocalTensor simulation in this torch
        return torch
    return torch if enabled_local_tensor_mode() is None else _LocalDeviceHandle(torch, "cpu")

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
    "dispatcher",
    "propagator",
    "is_local_tensor",
    "local_tensor_mode_disabled",
    "run_per_rank",
]

TORCH_VERSION = TorchVersion(torch.__version__)

# torch's own aten.view.dtype strategy: none up to 2.6, in op_strategy_funcs (without schema info,
# next to clone/detach in _tensor_ops.py) in 2.7-2.13, in op_single_dim_strategy_funcs in 2.14;
# installing qstate's rule replaces, adds or removes accordingly (``installed()`` says which).


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


def is_local_tensor(t: Any) -> bool:
    """Whether ``t`` is a ``LocalTensor`` (the shards of all simulated ranks at once)."""
    try:
        from torch.distributed._local_tensor import LocalTensor
    except ImportError:  # no LocalTensor simulation in this torch
        return False
    return isinstance(t, LocalTensor)


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

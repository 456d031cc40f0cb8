"""Random ops on CPU meshes: per-shard seeds (the series' CPU RNG tracker, at run time).

DTensor gives random ops an RNG tracker only on meshes whose device can set an offset of a
counter-based generator (CUDA-like); on a CPU mesh each rank runs the plain op on its shard, so
ranks seeded alike draw the same numbers on every shard. Here, for each call of an op in
``OpDispatcher._random_ops`` on a CPU mesh:

1. every rank draws one 64-bit key from the generator (the user's ``generator=`` if passed, else
   the default CPU generator): ``torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64)``;
2. runs torch's local op on the default CPU generator seeded with :func:`shard_seed` of the key
   and its shard's linear index (``_calc_shard_info`` / ``_calc_shard_linear_idx``, as the offset
   tracker numbers shards);
3. restores the default generator to its state after the draw.

Distinct shards draw independent numbers, replicas agree, every rank's generator advances by one
draw, and no collective is issued per op. An RNG tracker holds the scheme (the series'
``CPUSeedBasedRNGTracker``): the first such op while DTensor has none creates it, and its creation
sets every rank's CPU generator to rank 0's state (one broadcast), warning when they differed, as
torch's CUDA tracker does; ``manual_seed`` on a CPU mesh creates it without the sync. Meshes of
other device types keep torch's path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qstate import _random
from qstate.dtensor_rules import _compat, _probe
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "cpu_random_handler", "drop_tracker", "shard_seed"]

#: torch's text, on torch's logger, for the same event (``OffsetBasedRNGTracker``'s state sync)
_RNG_STATE_SYNC_WARNING = (
    "DTensor is synchronizing RNG states of every rank with the state from rank 0. "
    "This behavior is deprecated. "
    "Please call `torch.manual_seed()` on every rank that participates in SPMD DTensor Operations with "
    "the same seed. If using Pipeline Parallelism, each pipeline state would use a different seed, "
    "but all ranks belonging to one pipeline stage would use the same seed."
)
_LOGGER = logging.getLogger("torch.distributed.tensor._random")

def shard_seed(key: int, shard_index: int) -> int:
    """The seed of shard ``shard_index`` for a call whose key is ``key``: splitmix64's output for
    ``key + (shard_index + 1) * GAMMA``, halved into ``manual_seed``'s range ``[0, 2**63)``."""
    return _random.mix(key + (shard_index + 1) * _random.GAMMA) >> 1


def _draw_key(generator: torch.Generator | None) -> torch.Tensor:
    gen = torch.default_generator if generator is None else generator
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, generator=gen)


@_compat.run_per_rank
def _seeded_state(spec: Any, coordinate: Any, key: torch.Tensor) -> torch.Tensor:
    """Per rank: the state of a CPU generator seeded for this rank's shard."""
    from torch.distributed.tensor._random import _calc_shard_info, _calc_shard_linear_idx

    index = int(_calc_shard_linear_idx(*_calc_shard_info(list(coordinate), spec)))
    return torch.Generator().manual_seed(shard_seed(int(key), index)).get_state()


@_compat.run_per_rank
def _warn_if_differs(state: torch.Tensor, synced: torch.Tensor) -> None:
    if not torch.equal(state, synced):
        _LOGGER.warning(_RNG_STATE_SYNC_WARNING)


@contextlib.contextmanager
def _seeded_region(spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
    """The default CPU generator seeded for this rank's shard of ``spec`` (per simulated rank under
    ``LocalTensorMode``), and restored to its state after the key draw on exit."""
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        yield
        return
    rng = _compat.cpu_rng_states()
    if generator is None:  # per rank (per simulated rank under LocalTensorMode)
        key = _draw_key(None)
    else:  # one object, shared by simulated ranks: one draw
        with _compat.local_tensor_mode_disabled():
            key = _draw_key(generator)
    after_draw = rng.get_rng_state()
    rng.set_rng_state(_seeded_state(spec, coordinate, key))
    try:
        yield
    finally:
        rng.set_rng_state(after_draw)


@functools.cache
def _tracker_class() -> type:
    """The tracker class, a subclass of torch's ``_RNGStateTracker`` (made on first use, so that
    importing qstate imports no DTensor module)."""
    from torch.distributed.tensor._random import _RNGStateTracker

    class CPUSeedBasedRNGTracker(_RNGStateTracker):
        """DTensor's RNG tracker for CPU meshes: per-shard seeds; created with ``run_state_sync``,
        it sets every rank's CPU generator to rank 0's state, warning where it differed."""

        def __init__(self, run_state_sync: bool = True) -> None:
            super().__init__(torch.device("cpu"))
            if run_state_sync:
                rng = _compat.cpu_rng_states()
                state = rng.get_rng_state()
                synced = state.clone()
                torch.distributed.broadcast(synced, 0)
                _warn_if_differs(state, synced)
                rng.set_rng_state(synced)

        def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Any:
            if not self.distribute_region_enabled:
                return contextlib.nullcontext()
            return _seeded_region(spec, generator)

    return CPUSeedBasedRNGTracker


def _tracker(run_state_sync: bool = True) -> None:
    """DTensor's RNG tracker: a CPU one created where DTensor has none."""
    from torch.distributed.tensor import _random as dtensor_random

    if dtensor_random._rng_tracker is None:
        dtensor_random._rng_tracker = _tracker_class()(run_state_sync)


def drop_tracker() -> None:
    """DTensor's RNG tracker back to none if it is a CPU one made here."""
    from torch.distributed.tensor import _random as dtensor_random

    if _tracker_class.cache_info().currsize and isinstance(dtensor_random._rng_tracker, _tracker_class()):
        dtensor_random._rng_tracker = None


def cpu_random_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """A random op on a CPU mesh: torch's path, with DTensor's RNG tracker created where it has none
    (torch creates its own only for CUDA-like meshes); the tracker seeds the local op."""
    from torch.distributed._functional_collectives import _are_we_tracing

    _tracker(run_state_sync=not _are_we_tracing())
    return _compat.dispatch_as_torch(op, args, kwargs)


@_probe.checked
def _cpu_meshes_lack_rng() -> bool:
    """Whether torch leaves CPU meshes out of its RNG tracking (``is_rng_supported_mesh``)."""
    import warnings

    from torch.distributed.tensor._random import is_rng_supported_mesh

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return not is_rng_supported_mesh(_probe.mesh())


def supported_on_cpu(original: Callable[..., bool]) -> Callable[..., bool]:
    """``is_rng_supported_mesh``: True for CPU meshes too."""

    def is_rng_supported_mesh(device_mesh: Any) -> bool:
        return device_mesh.device_type == "cpu" or original(device_mesh)

    return is_rng_supported_mesh


def seeded_on_cpu(original: Callable[..., None]) -> Callable[..., None]:
    """``torch.distributed.tensor._random.manual_seed`` on a CPU mesh creates the CPU tracker (without
    the state sync) where DTensor has none, then seeds as torch does."""

    def manual_seed(seed: int, device_mesh: Any) -> None:
        if device_mesh.device_type == "cpu":
            _tracker(run_state_sync=False)
        return original(seed, device_mesh)

    return manual_seed


def factories_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_dtensor_init_helper`` (``torch.distributed.tensor.rand``/``randn``) on a CPU mesh creates the
    CPU tracker where DTensor has none; torch's helper then draws the local tensor in its region."""

    def _dtensor_init_helper(init_op: Any, size: torch.Size, device_mesh: Any = None, placements: Any = None,
                             **kwargs: Any) -> Any:
        from torch.distributed.device_mesh import _mesh_resources

        mesh = device_mesh or _mesh_resources.get_current_mesh()
        if init_op in (torch.rand, torch.randn) and mesh.device_type == "cpu":
            _tracker()
        return original(init_op, size, device_mesh, placements, **kwargs)

    return _dtensor_init_helper


def _random_ops() -> list[torch._ops.OpOverload]:
    return sorted(_compat.dispatcher()._random_ops, key=str)


RULES: tuple[Rule, ...] = tuple(
    Rule(op=op, form="handler", impl=cpu_random_handler, needed=_cpu_meshes_lack_rng, device_type="cpu",
         reason="random op on a CPU mesh: per-shard seeds splitmix64(key, shard index), as on CUDA meshes "
                "distinct shards draw distinct numbers (torch drew identical shards)")
    for op in _random_ops()
) + tuple(
    Rule(op=name, form="function", impl=impl, needed=_cpu_meshes_lack_rng, device_type="cpu", module=module,
         reason=reason)
    for module, name, impl, reason in (
        ("torch.distributed.tensor._random", "is_rng_supported_mesh", supported_on_cpu,
         "CPU meshes have DTensor RNG support (per-shard seeds)"),
        ("torch.distributed.tensor._random", "manual_seed", seeded_on_cpu,
         "manual_seed on a CPU mesh seeds every rank's CPU generator"),
        ("torch.distributed.tensor._api", "_dtensor_init_helper", factories_on_cpu,
         "torch.distributed.tensor.rand/randn on a CPU mesh: per-shard seeds"),
    )
)

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
draw, and no collective is issued per op. Like torch's CUDA tracker when it is created, the first
such op in the process (while DTensor has no RNG tracker) sets every rank's CPU generator to rank
0's state (one broadcast over the default group), warning when they differed. Meshes of other
device types keep torch's path untouched (the handlers are keyed by device type,
:class:`~qstate.dtensor_rules._registry.DeviceHandlers`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from qstate import _random
from qstate.dtensor_rules import _compat, _probe
from qstate.dtensor_rules._registry import Rule

__all__ = ["RULES", "cpu_random_handler", "shard_seed"]

#: torch's text, on torch's logger, for the same event (``OffsetBasedRNGTracker``'s state sync)
_RNG_STATE_SYNC_WARNING = (
    "DTensor is synchronizing RNG states of every rank with the state from rank 0. "
    "This behavior is deprecated. "
    "Please call `torch.manual_seed()` on every rank that participates in SPMD DTensor Operations with "
    "the same seed. If using Pipeline Parallelism, each pipeline state would use a different seed, "
    "but all ranks belonging to one pipeline stage would use the same seed."
)
_LOGGER = logging.getLogger("torch.distributed.tensor._random")

#: whether the CPU generators were synchronized (once per process, as torch creates its tracker once)
_synced = False


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


def _sync_once(rng: Any) -> None:
    """Every rank's CPU generator set to rank 0's state, the first time (not while tracing)."""
    global _synced
    from torch.distributed.tensor import _random as dtensor_random
    from torch.distributed._functional_collectives import _are_we_tracing

    if _synced or dtensor_random._rng_tracker is not None or _are_we_tracing():
        return
    state = rng.get_rng_state()
    synced = state.clone()
    torch.distributed.broadcast(synced, 0)
    _warn_if_differs(state, synced)
    rng.set_rng_state(synced)
    _synced = True


@contextlib.contextmanager
def _shard_seeds(spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
    """The default CPU generator seeded for this rank's shard of ``spec`` (per simulated rank under
    ``LocalTensorMode``), and restored to its state after the key draw on exit."""
    from torch.distributed.tensor import _random as dtensor_random

    coordinate = spec.mesh.get_coordinate()
    tracker = dtensor_random._rng_tracker
    if coordinate is None or (tracker is not None and not tracker.distribute_region_enabled):
        yield
        return
    rng = _compat.cpu_rng_states()
    _sync_once(rng)
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


def _around_local_op(args: tuple, op_info: Any) -> Any:
    """Per-shard seeds around torch's local op, for the shards of ``args[0]`` (the DTensor whose spec
    torch's RNG tracker reads); none for meta tensors, as torch's tracker."""
    if args[0]._local_tensor.is_meta:
        return contextlib.nullcontext()
    return _shard_seeds(args[0]._spec, op_info.local_kwargs.get("generator"))


def cpu_random_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """A random op on a CPU mesh: torch's path, its local op on per-shard seeds."""
    return _compat.dispatch_as_torch(op, args, kwargs, _around_local_op)


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
    """``torch.distributed.tensor._random.manual_seed`` on a CPU mesh: ``torch.manual_seed(seed)`` on
    every rank of the mesh, and no later state sync (torch creates its tracker here, unsynced)."""

    def manual_seed(seed: int, device_mesh: Any) -> None:
        global _synced
        if device_mesh.device_type != "cpu":
            return original(seed, device_mesh)
        _synced = True
        if device_mesh.get_coordinate() is None:
            raise RuntimeError(
                "manual_seed requires the current rank to be a part of the device mesh "
                "otherwise DTensor RNG state on the rank will not be initialized and "
                "the behavior of DTensor random ops is undefined.")
        torch.manual_seed(seed)

    return manual_seed


def factories_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_dtensor_init_helper`` (``torch.distributed.tensor.rand``/``randn``) on a CPU mesh: the local
    tensor drawn on per-shard seeds, as random ops are."""

    def _dtensor_init_helper(init_op: Any, size: torch.Size, device_mesh: Any = None, placements: Any = None,
                             **kwargs: Any) -> Any:
        from torch.distributed.device_mesh import _mesh_resources
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = device_mesh or _mesh_resources.get_current_mesh()
        if init_op not in (torch.rand, torch.randn) or mesh.device_type != "cpu":
            return original(init_op, size, device_mesh, placements, **kwargs)
        placements = tuple(placements or (Replicate(),) * mesh.ndim)
        if mesh.ndim != len(placements):
            raise AssertionError("mesh dimension does not match the length of placements")
        if kwargs["layout"] != torch.strided:
            raise AssertionError("layout value not supported!")
        kwargs["device"] = "cpu"
        stride = torch._prims_common.make_contiguous_strides_for(size)
        local_shape, _ = compute_local_shape_and_global_offset(size, mesh, placements)
        meta = TensorMeta(size, stride, kwargs.get("dtype") or torch.get_default_dtype())
        spec = DTensorSpec(mesh, placements, tensor_meta=meta)
        with _shard_seeds(spec):
            local = init_op(local_shape, **kwargs)
        spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(size, stride, local.dtype))
        return DTensor(local, spec, requires_grad=kwargs["requires_grad"])

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

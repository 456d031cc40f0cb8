"""Validation harness for DTensor sharding rules, in one process.

Given an op and inputs (full tensors + placements), :func:`run_case`

1. computes the plain-tensor reference (``reference`` or ``op`` on clones);
2. builds the DTensor inputs under ``LocalTensorMode`` -- uneven ``torch.chunk``
   shards, and ``Partial`` inputs split so that the reduction is *exact* in any
   order (so a bitwise comparison is meaningful);
3. runs ``op`` on them inside ``CommDebugMode`` and records the collectives;
4. checks every rank's local shard has the shape its spec implies, and that
   ``full_tensor()`` on every rank equals the reference (bitwise by default).

The The :mod:`hypothesis` strategies :func:`mesh_shapes`, :func:`shapes` and
:func:`placements` drive it from the tests.  Nothing here depends on
``qstate``: it validates whatever rules are currently registered with DTensor
(that is how the tests show torch's own rules failing).

Typical use::

    harness = Harness()
    x = torch.randn(4, 6)            # plain tensors: build inputs outside the simulation
    with harness.simulate():
        mesh = harness.mesh((2, 2))
        result = run_case(lambda t: t.view(torch.int16),
                          [DArg(x, (Shard(1), Replicate()))], mesh)
        assert result.ok, result.error
        print(result.comm_counts)    # {} -- collectives issued by the op itself
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard


__all__ = [
    "DArg",
    "CaseResult",
    "Harness",
    "MESH_SHAPES",
    "WORLD_SIZE",
    "bits_equal",
    "chunk_shard",
    "ensure_fake_process_group",
    "expected_local_shape",
    "make_dtensor",
    "random_tensor",
    "rank_coordinate",
    "mesh_shapes",
    "placements",
    "run_case",
    "shapes",
]

WORLD_SIZE = 4
MESH_SHAPES: tuple[tuple[int, ...], ...] = ((4,), (2, 2))
REDUCE_OPS = ("sum", "avg", "max", "min")


def ensure_fake_process_group(world_size: int = WORLD_SIZE) -> None:
    """Init the ``fake`` process group once per process (reused if already there)."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"a process group of world size {dist.get_world_size()} is already "
                f"initialized; the DTensor harness needs {world_size}"
            )
        return
    dist.init_process_group("fake", rank=0, world_size=world_size)


class Harness:
    """Simulated ranks plus cached device meshes (meshes outlive one simulation)."""

    def __init__(self, world_size: int = WORLD_SIZE) -> None:
        ensure_fake_process_group(world_size)
        self.world_size = world_size
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}

    @contextlib.contextmanager
    def simulate(self) -> Iterator[LocalTensorMode]:
        with LocalTensorMode(self.world_size) as lm:
            yield lm

    def mesh(self, shape: Sequence[int]) -> DeviceMesh:
        """A row-major ``cpu`` mesh of this shape (call inside :meth:`simulate`)."""
        shape = tuple(shape)
        if math.prod(shape) != self.world_size:
            raise ValueError(f"mesh {shape} does not cover {self.world_size} ranks")
        if shape not in self._meshes:
            self._meshes[shape] = init_device_mesh("cpu", shape)
        return self._meshes[shape]


def _lm() -> LocalTensorMode:
    from torch.distributed._local_tensor import local_tensor_mode

    lm = local_tensor_mode()
    if lm is None:
        raise RuntimeError("run inside Harness.simulate()")
    return lm


# ------------------------------------------------------------- input building
@dataclasses.dataclass(frozen=True)
class DArg:
    """A DTensor argument: the global value and its placements (one per mesh dim)."""

    full: torch.Tensor
    placements: tuple[Placement, ...]


def random_tensor(
    shape: Sequence[int], dtype: torch.dtype, seed: int, *, finite: bool = False
) -> torch.Tensor:
    """Deterministic random *bits* viewed as ``dtype`` (NaNs/infs included unless ``finite``).

    ``finite`` also bounds floats to ``|x| <= 2**10`` with 8 significant bits, so
    sums of a few of them (Partial inputs) are exact in every float dtype.
    Always a plain tensor, also when called under ``LocalTensorMode``.
    """
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        return _random_tensor(tuple(shape), dtype, seed, finite)


def _random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, finite: bool
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    if finite and dtype.is_floating_point:
        mant = torch.randint(-127, 128, (n,), generator=g, dtype=torch.int64)
        exp = torch.randint(-8, 3, (n,), generator=g, dtype=torch.int64)
        return (mant.double() * torch.pow(2.0, exp.double())).to(dtype).view(tuple(shape))
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.int64)
    return raw.to(torch.uint8).view(dtype).view(tuple(shape)).clone()


def rank_coordinate(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    """Coordinate of ``rank`` in a row-major mesh built by :meth:`Harness.mesh`."""
    coord = []
    for size in reversed(tuple(mesh.shape)):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def chunk_shard(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    """``torch.chunk`` shard ``i`` of ``n`` (empty past the last chunk), as DTensor does."""
    chunks = torch.chunk(t, n, dim=dim) if t.size(dim) > 0 else ()
    if i < len(chunks):
        return chunks[i]
    return t.narrow(dim, t.size(dim), 0)


def expected_local_shape(
    shape: Sequence[int], placements: Sequence[Placement], mesh: DeviceMesh, rank: int
) -> tuple[int, ...]:
    """Local shape a rank must hold (``torch.chunk`` sizes, left-to-right shard order)."""
    local = list(shape)
    coord = rank_coordinate(mesh, rank)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            size, n = local[p.dim], mesh.size(m)
            chunk = -(-size // n) if size else 0
            start = min(coord[m] * chunk, size)
            local[p.dim] = min(start + chunk, size) - start
    return tuple(local)


def _partial_pieces(
    x: torch.Tensor, reduce_op: str, group_size: int, seed: int
) -> list[torch.Tensor]:
    """``group_size`` tensors whose ``reduce_op`` is ``x`` exactly, in any order.

    sum: a rotation of (2x, -x) or (x, x, -x, 0, ...): every partial sum is one of
    -x, 0, x, 2x.  avg: alternating (2x, 0): partial sums 0, 2x, 4x, ...  max/min:
    one member holds x, the others something <= x (>= x).  The member holding
    each role differs per element.
    """
    n = group_size
    g = torch.Generator().manual_seed(seed)
    shift = torch.randint(0, n, tuple(x.shape), generator=g)
    zero = torch.zeros_like(x)
    if reduce_op == "sum":
        pattern = [2 * x, -x] if n == 2 else [x, x, -x] + [zero] * (n - 3)
    elif reduce_op == "avg":
        pattern = [2 * x, zero] * (n // 2) if n % 2 == 0 else [x] * n
    elif reduce_op in ("max", "min"):
        other = random_tensor(tuple(x.shape), x.dtype, seed + 1, finite=True)
        other = torch.minimum(x, other) if reduce_op == "max" else torch.maximum(x, other)
        pattern = [x] + [other] * (n - 1)
    else:
        raise ValueError(reduce_op)
    stacked = torch.stack(pattern)
    return [stacked.gather(0, ((shift + i) % n).unsqueeze(0))[0] for i in range(n)]


def make_dtensor(
    full: torch.Tensor, placements: Sequence[Placement], mesh: DeviceMesh, *, seed: int = 0
) -> DTensor:
    """A DTensor with these placements whose ``full_tensor()`` is exactly ``full``.

    All ``Partial`` placements of one tensor must share a reduce op.
    """
    lm = _lm()
    if isinstance(full, LocalTensor):
        raise TypeError("make_dtensor needs a plain tensor (build it outside LocalTensorMode)")
    placements = tuple(placements)
    partial_dims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    reduce_ops = {placements[m].reduce_op for m in partial_dims}  # type: ignore[attr-defined]
    if len(reduce_ops) > 1:
        raise ValueError(f"mixed Partial reduce ops are not supported: {placements}")
    reduce_op = reduce_ops.pop() if reduce_ops else ""
    group_size = math.prod(mesh.size(m) for m in partial_dims)
    with lm.disable():
        full = full.detach().clone()

        def local(rank: int) -> torch.Tensor:
            coord = rank_coordinate(mesh, rank)
            t = full
            for m, p in enumerate(placements):
                if isinstance(p, Shard):
                    t = chunk_shard(t, p.dim, mesh.size(m), coord[m])
            if partial_dims:
                member = 0
                for m in partial_dims:
                    member = member * mesh.size(m) + coord[m]
                t = _partial_pieces(t, reduce_op, group_size, seed)[member]
            return t.clone(memory_format=torch.contiguous_format)

        locals_ = LocalTensor({r: local(r) for r in sorted(lm.ranks)})
    return DTensor.from_local(
        locals_, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


# ------------------------------------------------------------------ comparing
def _as_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype == torch.bool or t.dtype.is_complex:
        return t
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(as_int[t.dtype.itemsize])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern (NaN payloads included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_as_bits(a), _as_bits(b))


@dataclasses.dataclass
class CaseResult:
    ok: bool
    error: str = ""
    skipped: bool = False  # the plain reference itself raised: not a valid case
    comm_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    output_placements: tuple[Placement, ...] | None = None

    @property
    def total_comms(self) -> int:
        return sum(self.comm_counts.values())


def _comm_name(key: Any) -> str:
    return str(getattr(key, "_qualified_op_name", key)).replace("::", ".")


def _describe(args: Sequence[Any]) -> str:
    parts = []
    for a in args:
        if isinstance(a, DArg):
            parts.append(f"{a.full.dtype}{list(a.full.shape)}@{a.placements}")
        else:
            parts.append(repr(a))
    return ", ".join(parts)


def run_case(
    op: Callable[..., Any],
    args: Sequence[Any],
    mesh: DeviceMesh,
    *,
    reference: Callable[..., Any] | None = None,
    compare: str = "bits",
    seed: int = 0,
) -> CaseResult:
    """Run ``op`` on DTensors built from ``args`` and compare with plain torch.

    ``args`` mixes :class:`DArg` (becomes a DTensor) and plain values.  The
    reference is ``reference(*plain_args)`` (default ``op``) on clones of the
    full tensors.  ``compare`` is ``"bits"`` or ``"close"``.
    """
    lm = _lm()
    for a in args:
        if isinstance(a, DArg) and isinstance(a.full, LocalTensor):
            raise TypeError("DArg.full must be a plain tensor (build it outside LocalTensorMode)")
    where = f"{getattr(op, '__name__', op)}({_describe(args)}) on mesh {tuple(mesh.shape)}"
    with lm.disable():
        plain = [a.full.clone() if isinstance(a, DArg) else a for a in args]
        try:
            expected = (reference or op)(*plain)
        except Exception as e:  # not a valid input for the op itself
            return CaseResult(ok=True, skipped=True, error=f"reference raised {e!r}")
    dargs = [
        make_dtensor(a.full, a.placements, mesh, seed=seed + i) if isinstance(a, DArg) else a
        for i, a in enumerate(args)
    ]
    try:
        with CommDebugMode() as comm:
            out = op(*dargs)
    except Exception as e:
        return CaseResult(ok=False, error=f"{where}: DTensor raised {type(e).__name__}: {e}")
    counts = {_comm_name(k): v for k, v in comm.get_comm_counts().items() if v}
    result = CaseResult(ok=True, comm_counts=counts)
    if not isinstance(out, DTensor):
        result.ok, result.error = False, f"{where}: returned {type(out).__name__}, not a DTensor"
        return result
    result.output_placements = tuple(out.placements)
    where += f" -> {result.output_placements}"
    if out.shape != expected.shape or out.dtype != expected.dtype:
        result.ok = False
        result.error = (
            f"{where}: global {out.dtype}{list(out.shape)} != reference "
            f"{expected.dtype}{list(expected.shape)}"
        )
        return result
    local = out._local_tensor
    for rank in sorted(lm.ranks):
        want = expected_local_shape(out.shape, out.placements, mesh, rank)
        held = local._local_tensors[rank] if isinstance(local, LocalTensor) else local
        got = tuple(held.shape)
        if got != want:
            result.ok = False
            result.error = f"{where}: rank {rank} holds local shape {got}, its spec implies {want}"
            return result
    try:
        full = out.full_tensor()
    except Exception as e:
        result.ok = False
        result.error = f"{where}: full_tensor() raised {type(e).__name__}: {e}"
        return result
    with lm.disable():
        fulls = full._local_tensors if isinstance(full, LocalTensor) else {0: full}
        for rank, value in sorted(fulls.items()):
            same = (
                bits_equal(value, expected)
                if compare == "bits"
                else torch.allclose(value.double(), expected.double(), equal_nan=True)
            )
            if not same:
                result.ok = False
                result.error = f"{where}: rank {rank} full_tensor() differs from plain torch"
                return result
    return result


# -------------------------------------------------------- hypothesis strategies
def mesh_shapes() -> st.SearchStrategy[tuple[int, ...]]:
    """The simulated meshes: ``(4,)`` and ``(2, 2)``."""
    return st.sampled_from(MESH_SHAPES)


def shapes(
    min_ndim: int = 1, max_ndim: int = 3, max_side: int = 9
) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes; sides from 0, so empty and uneven shards are common."""
    return st.lists(st.integers(0, max_side), min_size=min_ndim, max_size=max_ndim).map(tuple)


@st.composite
def placements(
    draw: st.DrawFn, ndim: int, mesh_ndim: int, reduce_ops: Sequence[str] = REDUCE_OPS
) -> tuple[Placement, ...]:
    """One placement per mesh dim; all ``Partial`` s of one tensor share a reduce op."""
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
    if reduce_ops:
        choices.append(Partial(draw(st.sampled_from(tuple(reduce_ops)))))
    return tuple(draw(st.sampled_from(choices)) for _ in range(mesh_ndim))

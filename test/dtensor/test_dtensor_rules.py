"""qstate.dtensor_rules: install() is the upstream series at run time, checked against plain torch.

* each rule against plain torch on the unsharded tensor (the DTensor harness: fake process group +
  LocalTensorMode, 4 ranks; hypothesis sweeps marked ``exhaustive``);
* the refusals (view.dtype) pinned with ``assertExpectedInline``;
* random ops on CPU meshes equal the series' numbers computed another way (splitmix64 of the key
  and the shard's index, written out), and act on CPU meshes only (read from the installed tables);
* install / uninstall / installed() / feature checks, and ``import qstate`` changes no torch op.

The opt-in rules (:func:`qstate.dtensor_rules.install`) are installed for this module by a fixture.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import expecttest
import pytest
import torch
from hypothesis import given, HealthCheck, settings, strategies as st

import qstate.dtensor_rules as rules
from dtensor_harness import (
    chunk_shard,
    DArg,
    Harness,
    make_dtensor,
    mesh_shapes,
    placements as placements_st,
    random_tensor,
    rank_coordinate,
    run_case,
    shapes,
)
from rounding_keys import splitmix64
from qstate.dtensor_rules._dtypes import cast_commutes_with_reduction
from qstate.dtensor_rules._registry import DeviceHandlers
from torch.distributed.tensor import distribute_tensor, DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard


aten = torch.ops.aten

PROPERTY = settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)

_HARNESS: Harness | None = None


def harness() -> Harness:
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness()
    return _HARNESS


@pytest.fixture(scope="module", autouse=True)
def rules_installed() -> Iterator[None]:
    """The opt-in rules are installed for this module; the prior state is restored after."""
    was_installed = rules.is_installed()
    rules.install()
    yield
    if not was_installed:
        rules.uninstall()


@pytest.fixture
def torch_rules() -> Iterator[None]:
    """Run a test against torch's own rules; always reinstall afterwards."""
    rules.uninstall()
    try:
        yield
    finally:
        rules.install()


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = name
    return fn


def _view(dtype: torch.dtype) -> Callable[[Any], Any]:
    return _named(lambda t: t.view(dtype), f"view({dtype})")


def _is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and dtype != torch.bool


def _reduce_ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    # Partial(avg) of integers is not an integer: not a placement ints can have
    return ("sum", "avg", "max", "min") if dtype.is_floating_point else ("sum", "max", "min")

# =============================================================== view.dtype
VIEW_DTYPES = [
    torch.float32, torch.int32, torch.int16, torch.bfloat16, torch.uint8,
    torch.float64, torch.float16, torch.int8, torch.int64,
]
REQUIRED_PAIRS = [
    (torch.float32, torch.int32), (torch.int32, torch.float32), (torch.float32, torch.int16),
    (torch.bfloat16, torch.int16), (torch.bfloat16, torch.uint8), (torch.uint8, torch.bfloat16),
    (torch.float32, torch.float64),
]


def _last_dim_bytes(
    n: int, itemsize: int, last: int, placements: tuple[Placement, ...], mesh: Any, rank: int
) -> list[int]:
    """Global byte offsets of the last-dim elements a rank holds (independent of the rule)."""
    coord = rank_coordinate(mesh, rank)
    idx = list(range(n))
    for m, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == last:  # torch.chunk on a list
            size = -(-len(idx) // mesh.size(m)) if idx else 0
            idx = idx[coord[m] * size:(coord[m] + 1) * size]
    return [i * itemsize + b for i in idx for b in range(itemsize)]


def _view_needs_comm(
    shape: tuple[int, ...],
    src: torch.dtype,
    dst: torch.dtype,
    placements: tuple[Placement, ...],
    mesh: Any,
) -> bool:
    """Whether a correct view(dst) must communicate (computed without the rule)."""
    for p in placements:
        if isinstance(p, Partial) and src != dst:
            same_ring = _is_int(src) and _is_int(dst) and src.itemsize == dst.itemsize
            if not (same_ring and p.reduce_op == "sum"):
                return True
    if src.itemsize == dst.itemsize or not shape:
        return False
    last = len(shape) - 1
    if not any(isinstance(p, Shard) and p.dim == last for p in placements):
        return False
    n_out = shape[last] * src.itemsize // dst.itemsize
    for rank in range(math.prod(mesh.shape)):
        have = _last_dim_bytes(shape[last], src.itemsize, last, placements, mesh, rank)
        want = _last_dim_bytes(n_out, dst.itemsize, last, placements, mesh, rank)
        if have != want:
            return True
        # an empty contiguous [.., 0] shard has stride 1 on dim -2: no wider dtype fits
        if dst.itemsize > src.itemsize and not have and len(shape) > 1:
            return True
    return False


@st.composite
def view_cases(draw: Any) -> tuple[Any, ...]:
    src, dst = draw(
        st.one_of(
            st.sampled_from(REQUIRED_PAIRS),
            st.tuples(st.sampled_from(VIEW_DTYPES), st.sampled_from(VIEW_DTYPES)),
        )
    )
    mesh_shape = draw(mesh_shapes())
    ndim = draw(st.integers(0 if src.itemsize == dst.itemsize else 1, 3))
    shape = list(draw(shapes(ndim, ndim, 7))) if ndim else []
    if ndim:
        ratio = max(1, dst.itemsize // src.itemsize)
        # a wider dtype cannot view an empty last dim of a >1-d tensor (stride 1 on dim -2)
        lowest = 1 if ratio > 1 and ndim > 1 else 0
        shape[-1] = draw(st.integers(lowest, 10 // ratio)) * ratio
    placements = draw(placements_st(ndim, len(mesh_shape), _reduce_ops_for(src)))
    seed = draw(st.integers(0, 2**16))
    return src, dst, tuple(shape), mesh_shape, placements, seed



@pytest.mark.exhaustive  # the opt-in rules' property sweeps
@PROPERTY
@given(view_cases())
def test_view_dtype_property(case: tuple[Any, ...]) -> None:
    """view(dtype) equals plain torch's view with no collective where a local view keeps the layout,
    and raises where it cannot (computed without the rule: :func:`_view_needs_comm`)."""
    src, dst, shape, mesh_shape, placements, seed = case
    h = harness()
    full = random_tensor(shape, src, seed, finite=True)
    with h.simulate():
        mesh = h.mesh(mesh_shape)
        result = run_case(_view(dst), [DArg(full, placements)], mesh, seed=seed)
        refuses = _view_needs_comm(shape, src, dst, placements, mesh)
    if refuses:
        assert not result.ok and "Cannot view a" in result.error, (case, result.error)
    else:
        assert result.ok, result.error
        assert result.total_comms == 0, result.comm_counts


@pytest.mark.parametrize("src,dst", REQUIRED_PAIRS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(8, 16), (7, 12)], ids=str)  # even, uneven
@pytest.mark.parametrize("mesh_shape,placements", [
    ((4,), (Replicate(),)), ((4,), (Shard(0),)), ((4,), (Shard(1),)), ((4,), (Partial("sum"),)),
    ((4,), (Partial("max"),)), ((2, 2), (Shard(0), Shard(1))), ((2, 2), (Shard(1), Shard(1))),
    ((2, 2), (Partial("sum"), Shard(0)))], ids=str)
def test_view_dtype_required_pairs(src, dst, shape, mesh_shape, placements) -> None:
    h = harness()
    full = random_tensor(shape, src, 7, finite=True)
    with h.simulate():
        mesh = h.mesh(mesh_shape)
        result = run_case(_view(dst), [DArg(full, placements)], mesh)
        refuses = _view_needs_comm(shape, src, dst, placements, mesh)
    assert result.ok != refuses, result.error
    assert result.total_comms == 0


def test_view_dtype_dtype_is_in_cache_key() -> None:
    """A second view of the same input to another dtype is not served from the cache."""
    h = harness()
    full = random_tensor((8, 6), torch.float32, 1)
    with h.simulate():
        d = make_dtensor(full, (Shard(0),), h.mesh((4,)))
        for dt, width in ((torch.int32, 6), (torch.int16, 12), (torch.uint8, 24)):
            t = d.view(dt)
            assert (t.shape, t.dtype) == ((8, width), dt)
            assert torch.equal(t.full_tensor()._local_tensors[3], full.view(dt))


class TestViewDtypeRefusals(expecttest.TestCase):
    def _error(self, full: torch.Tensor, placements: tuple[Placement, ...], dst: torch.dtype) -> str:
        h = harness()
        with h.simulate():
            d = make_dtensor(full, placements, h.mesh((4,)))
            with CommDebugMode() as comm, pytest.raises(RuntimeError) as e:
                d.view(dst)
        assert comm.get_total_counts() == 0
        return str(e.value).split("\n")[0]

    def test_partial(self) -> None:
        self.assertExpectedInline(self._error(torch.ones(4, 6), (Partial("sum"),), torch.int32), """\
Cannot view a P(sum) DTensor of dtype torch.float32 as torch.int32: the bits of a pending reduction are not the reduction of the bits. Please redistribute the tensor (e.g. to Replicate) before this operation.""")

    def test_uneven_last_dim_shard(self) -> None:
        # f32 -> i16 of a [4, 10] Shard(1): widths [3, 3, 3, 1] x 4 bytes != chunk(20) widths [5, 5, 5, 5] x 2
        self.assertExpectedInline(self._error(torch.ones(4, 10), (Shard(1),), torch.int16), """\
Cannot view a DTensor with placements (Shard(dim=1),) and shape (4, 10) from torch.float32 to torch.int16: the local last-dim shards are not (or, for a symbolic width, cannot be shown to be) the torch.chunk shards of the result. Please redistribute the tensor before this operation.""")


# ======================================================== casts on Partial
CAST_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8]


@pytest.mark.parametrize("reduce_op", ["sum", "max", "min"])
@pytest.mark.parametrize("src", CAST_DTYPES, ids=str)
@pytest.mark.parametrize("dst", CAST_DTYPES, ids=str)
def test_a_cast_said_to_commute_commutes(reduce_op: str, src: torch.dtype, dst: torch.dtype) -> None:
    """Where the one helper lets a Partial through a cast, casting each rank's addend first gives the
    cast of the reduction on values spanning the source's range (exact for max/min and integer sums;
    widening float sums round once less, the series' accepted cost)."""
    if not cast_commutes_with_reduction(reduce_op, src, dst):
        return
    g = torch.Generator().manual_seed(0)
    if src.is_floating_point:
        # a sum of 4 addends stays in range; a float-to-integer cast stays in the integer's range
        top = min(float(torch.finfo(src).max) / 8, 1e30)
        lo, hi = (-top, top) if dst.is_floating_point else (torch.iinfo(dst).min, torch.iinfo(dst).max)
        x = (torch.rand(4, 64, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(src)
    else:
        info = torch.iinfo(src)
        x = torch.randint(info.min, info.max, (4, 64), generator=g, dtype=torch.int64).to(src)
    if dst.is_floating_point and reduce_op == "sum" and not src.is_floating_point:
        return  # never said to commute
    reduce = {"sum": lambda t: t.sum(0, dtype=t.dtype), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}
    after, before = reduce[reduce_op](x.to(dst)), reduce[reduce_op](x).to(dst)
    if reduce_op == "sum" and dst.is_floating_point:
        bound = 4 * torch.finfo(src).eps * x.to(dst).abs().sum(0)
        assert ((after - before).abs() <= bound).all(), (after, before)
    else:
        assert torch.equal(after, before), (after, before)


@pytest.mark.parametrize("src,dst,reduce_op,keeps", [
    (torch.int32, torch.uint8, "max", False), (torch.uint8, torch.int32, "max", True),
    (torch.float32, torch.int32, "max", False), (torch.int32, torch.float32, "sum", False),
    (torch.float32, torch.bfloat16, "sum", False), (torch.bfloat16, torch.float32, "sum", True),
    (torch.int32, torch.int8, "sum", True), (torch.int8, torch.int32, "sum", False),
    (torch.float32, torch.bool, "max", False)], ids=str)
def test_to_copy_keeps_partial_only_through_casts_that_commute(src, dst, reduce_op, keeps) -> None:
    """``.to(dtype)`` equals plain torch and keeps ``Partial`` exactly where the cast commutes."""
    h = harness()
    info = torch.iinfo(src) if not src.is_floating_point else None
    full = (torch.tensor([info.max, info.min, 256, 255, -1, 0, 7, 1]).clamp(info.min, info.max).to(src)
            if info else torch.tensor([3.5, -2.25, 1e3, 255.75, 0.0, -7.0, 2.0, 1.0], dtype=src))
    with h.simulate():
        result = run_case(_named(lambda t: t.to(dst), "_to_copy"), [DArg(full, (Partial(reduce_op),))],
                          h.mesh((4,)), seed=1)
    assert result.ok, result.error
    assert result.output_placements == ((Partial(reduce_op),) if keeps else (Replicate(),))


def test_copy_into_uint8_partial_max_wraps_like_torch() -> None:
    """The issue's case: uint8 P(max).copy_(int32 P(max) [256, 255, ...]) is 0 where plain torch gives 0."""
    h = harness()
    src, dst = torch.tensor([256, 255, 3, 4], dtype=torch.int32), torch.zeros(4, dtype=torch.uint8)
    with h.simulate():
        result = run_case(_named(lambda a, b: a.copy_(b), "copy_"),
                          [DArg(dst, (Partial("max"),)),
                           DArg(src, (Partial("max"),))], h.mesh((4,)), seed=0)
    assert result.ok, result.error
    assert result.output_placements == (Replicate(),)
    assert src.to(torch.uint8)[0] == 0


# ============================================= qstate's own ops (no opt-in)
SR_LAYOUTS = [
    ((4,), (Replicate(),)),
    ((4,), (Shard(0),)),
    ((4,), (Shard(1),)),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Replicate(), Shard(0))),
    ((2, 2), (Shard(1), Shard(1))),
    ((2, 2), (Shard(0), Replicate())),
]


@pytest.mark.parametrize("shape", [(8, 16), (7, 10), (3, 2)], ids=str)
@pytest.mark.parametrize("mesh_shape,placements", SR_LAYOUTS + [((4,), (Partial("sum"),))], ids=str)
def test_qstate_stochastic_rounding_needs_no_opt_in_rule(torch_rules: None, shape, mesh_shape, placements) -> None:
    """What the optimizers run on DTensors (``key_draws`` + ``stochastic_round_bf16``) gives the
    unsharded bits shard by shard under torch's own rules: only qstate's ops' rules are needed."""
    from qstate._random import key_draws
    from qstate.optim import stochastic_round_bf16 as qstate_round

    h = harness()
    full = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 3
    key = 0x9E3779B97F4A7C15
    want = qstate_round(full, key_draws(key, full))
    partial = isinstance(placements[0], Partial)
    with h.simulate():
        mesh = h.mesh(mesh_shape)
        d = make_dtensor(full, placements, mesh)
        with CommDebugMode() as comm:
            out = qstate_round(d, key_draws(key, d))
        assert comm.get_total_counts() == (1 if partial else 0), comm.get_comm_counts()
        assert out.placements == ((Replicate(),) if partial else placements)
        whole = out.full_tensor()._local_tensors[0]
        assert torch.equal(whole.view(torch.int16), want.view(torch.int16))



@pytest.mark.parametrize("mesh_shape,placements", SR_LAYOUTS + [((4,), (Partial("sum"),))], ids=str)
def test_positional_randint_like_shards_are_slices_of_the_full_tensor(torch_rules: None, mesh_shape,
                                                                      placements) -> None:
    """The optimizers' draws without explicit ones: each shard holds its slice of what the full tensor
    draws from the same generator state (bits splitmix64(key, flat index), written out), no collective."""
    h = harness()
    full = torch.zeros(7, 10, dtype=torch.int32)
    g = torch.Generator().manual_seed(77)
    key = int(torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(77)))
    want = torch.tensor([(splitmix64(key, i) & ((1 << 63) - 1)) % 1000 - 5 for i in range(70)],
                        dtype=torch.int32).view(7, 10)
    assert torch.equal(rules.positional_randint_like(full, -5, 995, generator=torch.Generator().manual_seed(77)),
                       want)
    with h.simulate():
        d = make_dtensor(full, placements, h.mesh(mesh_shape))
        with CommDebugMode() as comm:
            out = rules.positional_randint_like(d, -5, 995, generator=g)
        whole = out.full_tensor()._local_tensors[0]
    assert comm.get_total_counts() == 0
    assert torch.equal(whole, want)


# ============================================================= Partial ops
FILL_DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.uint8]


@st.composite
def fill_cases(draw: Any) -> tuple[Any, ...]:
    dtype = draw(st.sampled_from(FILL_DTYPES))
    mesh_shape = draw(mesh_shapes())
    shape = draw(shapes(0, 3, 7))
    placements = draw(placements_st(len(shape), len(mesh_shape), _reduce_ops_for(dtype)))
    value = draw(st.integers(0, 100))
    as_tensor = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dtype, shape, mesh_shape, placements, value, as_tensor, seed


@pytest.mark.exhaustive  # the opt-in rules' property sweeps
@PROPERTY
@given(fill_cases())
def test_fill_property(case: tuple[Any, ...]) -> None:
    """W6: fill_ on any placement (Partial included) equals plain fill_, with no collective."""
    dtype, shape, mesh_shape, placements, value, as_tensor, seed = case
    h = harness()
    full = random_tensor(shape, dtype, seed, finite=True)

    def fill(t: Any) -> Any:
        return t.fill_(torch.tensor(value, dtype=dtype) if as_tensor else value)

    with h.simulate():
        mesh = h.mesh(mesh_shape)
        result = run_case(_named(fill, "fill_"), [DArg(full, placements)], mesh, seed=seed)
    assert result.ok and not result.skipped, result.error
    assert result.total_comms == 0, result.comm_counts


COPY_DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.int16]


@st.composite
def copy_cases(draw: Any) -> tuple[Any, ...]:
    self_dtype = draw(st.sampled_from(COPY_DTYPES))
    src_dtype = draw(st.sampled_from([self_dtype, *COPY_DTYPES]))
    mesh_shape = draw(mesh_shapes())
    shape = draw(shapes(1, 3, 7))
    # src broadcasts to self: a suffix of self's shape, some dims possibly 1
    k = draw(st.integers(0, len(shape)))
    src_shape = tuple(draw(st.sampled_from([s, 1])) for s in shape[len(shape) - k:])
    self_pl = draw(placements_st(len(shape), len(mesh_shape), _reduce_ops_for(self_dtype)))
    src_pl = draw(placements_st(len(src_shape), len(mesh_shape), _reduce_ops_for(src_dtype)))
    seed = draw(st.integers(0, 2**16))
    return self_dtype, src_dtype, shape, src_shape, mesh_shape, self_pl, src_pl, seed


@pytest.mark.exhaustive  # the opt-in rules' property sweeps
@PROPERTY
@given(copy_cases())
def test_copy_property(case: tuple[Any, ...]) -> None:
    """W9: copy_ into any placement (Partial self included) equals plain copy_."""
    self_dtype, src_dtype, shape, src_shape, mesh_shape, self_pl, src_pl, seed = case
    h = harness()
    dst = random_tensor(shape, self_dtype, seed, finite=True)
    src = random_tensor(src_shape, src_dtype, seed + 1, finite=True)
    with h.simulate():
        result = run_case(
            _named(lambda a, b: a.copy_(b), "copy_"),
            [DArg(dst, self_pl), DArg(src, src_pl)],
            h.mesh(mesh_shape),
            seed=seed,
        )
    assert result.ok and not result.skipped, result.error
    # the destination never moves; only src is redistributed
    if all(not isinstance(p, Partial) for p in self_pl):
        assert result.output_placements == self_pl


@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.int32, torch.uint8), (torch.int64, torch.int16),
                                                  (torch.float32, torch.int32), (torch.uint8, torch.int16),
                                                  (torch.int32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("reduce_op", ["max", "min"])
def test_copy_between_pending_max_min_keeps_only_casts_that_commute(src_dtype, dst_dtype, reduce_op) -> None:
    """copy_ keeps a Partial(max/min) only through a cast that commutes with the reduction: the
    values span the source dtype's range, where a narrowing cast wraps (uint8(256) == 0)."""
    h = harness()
    if src_dtype.is_floating_point:
        src = torch.tensor([3e9, -3e9, 2.5, 255.75, 1e30, -7.0], dtype=src_dtype)
    else:
        info = torch.iinfo(src_dtype)
        src = torch.tensor([info.max, info.min, 256, 255, -1, 0]).clamp(info.min, info.max).to(src_dtype)
    dst = torch.zeros(6, dtype=dst_dtype)
    partial = Partial(reduce_op)
    with h.simulate():
        result = run_case(_named(lambda a, b: a.copy_(b), "copy_"), [DArg(dst, (partial,)), DArg(src, (partial,))],
                          h.mesh((4,)), seed=0)
    if src_dtype.is_floating_point and not dst_dtype.is_floating_point:
        # float to integer is undefined outside the target's range (uint8(-1.0) is 255 on x86): reduced
        # first; torch's own copy_ of such values is undefined too, so compare placements only
        assert result.output_placements == (Replicate(),)
        return
    assert result.ok and not result.skipped, result.error
    commutes = dst_dtype.is_floating_point or (
        torch.iinfo(dst_dtype).min <= torch.iinfo(src_dtype).min
        and torch.iinfo(src_dtype).max <= torch.iinfo(dst_dtype).max)
    assert result.output_placements == ((partial,) if commutes else (Replicate(),))


INT_DTYPES = [torch.int32, torch.int64, torch.int16, torch.uint8]


@st.composite
def additive_cases(draw: Any) -> tuple[Any, ...]:
    op = draw(st.sampled_from(["add", "sub", "radd", "add", "sub", "add_", "sub_"]))
    dtype = draw(st.sampled_from(INT_DTYPES))
    # an integer self cannot take a float result in place
    other_dtype = dtype if op.endswith("_") else draw(st.sampled_from([dtype, torch.float32]))
    mesh_shape = draw(mesh_shapes())
    shape = draw(shapes(1, 2, 7))
    pa = draw(placements_st(len(shape), len(mesh_shape), ("sum", "max", "min")))
    pb = draw(placements_st(len(shape), len(mesh_shape), _reduce_ops_for(other_dtype)))
    seed = draw(st.integers(0, 2**16))
    return op, dtype, other_dtype, shape, mesh_shape, pa, pb, seed


@pytest.mark.exhaustive  # the opt-in rules' property sweeps
@settings(PROPERTY, max_examples=640)  # ~1 in 6 in-place cases end in the loud error
@given(additive_cases())
def test_integer_additive_property(case: tuple[Any, ...]) -> None:
    """W5/W5b: integer add/sub mixing Partial and Replicate equal plain torch (or raise clearly)."""
    op, dtype, other_dtype, shape, mesh_shape, pa, pb, seed = case
    h = harness()
    a = random_tensor(shape, dtype, seed, finite=True)
    b = random_tensor(shape, other_dtype, seed + 1, finite=True)
    fn = {
        "add": lambda x, y: x + y,
        "sub": lambda x, y: x - y,
        "add_": lambda x, y: x.add_(y),
        "sub_": lambda x, y: x.sub_(y),
        "radd": lambda x, y: y + x,
    }[op]
    with h.simulate():
        result = run_case(_named(fn, op), [DArg(a, pa), DArg(b, pb)], h.mesh(mesh_shape), seed=seed)
    if not result.ok and op.endswith("_") and "DTensor raised" in result.error:
        # loud, never wrong: an int Partial self cannot absorb the operand in place, or keeps
        # Partial(sum), which a Shard or Partial(max) operand cannot join (as for floats), and
        # torch 2.13 cannot bring a Replicate operand to an uneven Shard self
        return
    assert result.ok, result.error


@pytest.mark.parametrize("reduce_op,keeps", [("sum", True), ("max", False), ("min", False)])
@pytest.mark.parametrize("op", ["add", "sub", "add_"])
def test_integer_partial_plus_replicate(op: str, reduce_op: str, keeps: bool) -> None:
    """The series' example: int8 rows [127 - r, r] pending plus a replicated one equal plain torch (wrapping),
    keep the dtype, and keep ``Partial(sum)`` (the replicated operand partitioned exactly) but not max/min."""
    h = harness()
    full = torch.tensor([[127, 0], [126, 1], [125, 2], [124, 3]], dtype=torch.int8)
    one = torch.ones(2, dtype=torch.int8)
    fn = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "add_": lambda a, b: a.add_(b)}[op]
    reduced = {"sum": full.sum(0, dtype=torch.int8), "max": full.amax(0), "min": full.amin(0)}[reduce_op]
    with h.simulate():
        mesh = h.mesh((4,))
        pending = make_dtensor(reduced, (Partial(reduce_op),), mesh)
        if op == "add_" and not keeps:
            with pytest.raises(RuntimeError, match="in-place operations that require placement changes"):
                fn(pending, make_dtensor(one, (Replicate(),), mesh))
            return
        out = fn(pending, make_dtensor(one, (Replicate(),), mesh))
        assert out.dtype == torch.int8
        assert out.placements == ((Partial(reduce_op),) if keeps else (Replicate(),))
        assert torch.equal(out.full_tensor()._local_tensors[0], fn(reduced.clone(), one))


def test_integer_partial_promoted_to_float_reduces_first() -> None:
    """int32 ``Partial(sum)`` rows that wrap, plus a float32 ``Replicate``: the pending sum is reduced (and
    wraps) before the cast, as plain torch does (kept as Partial it would add the casts unwrapped)."""
    h = harness()
    full = torch.full((4, 3), 2**30, dtype=torch.int32)  # sums to 2**32: wraps to 0
    other = torch.tensor([0.5, 1.5, -2.0])
    reduced = full.sum(0, dtype=torch.int32)
    with h.simulate():
        mesh = h.mesh((4,))
        pending = DTensor.from_local(_rows(full), mesh, [Partial("sum")], run_check=False)
        out = pending + make_dtensor(other, (Replicate(),), mesh)
        whole = out.full_tensor()._local_tensors[0]
    assert out.placements == (Replicate(),)
    assert torch.equal(whole, reduced + other)


def _rows(full: torch.Tensor) -> Any:
    """A LocalTensor whose rank ``r`` holds row ``r`` of ``full``."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor({r: full[r].clone() for r in range(full.shape[0])})


def test_replicate_to_integer_partial_sum_is_exact() -> None:
    """``Replicate -> Partial(sum)`` of an integer tensor: the first rank keeps the value, the others zeros."""
    h = harness()
    v = torch.tensor([7, -3, 127], dtype=torch.int8)
    with h.simulate():
        p = distribute_tensor(v, h.mesh((4,)), [Partial("sum")])
        locals_ = p.to_local()._local_tensors
        assert p.dtype == torch.int8 and torch.equal(p.full_tensor()._local_tensors[0], v)
    assert torch.equal(locals_[0], v) and all(not locals_[r].any() for r in (1, 2, 3))


@st.composite
def shift_cases(draw: Any) -> tuple[Any, ...]:
    op = draw(st.sampled_from([">>", "<<", ">>t", "<<t"]))
    dtype = draw(st.sampled_from(INT_DTYPES))
    mesh_shape = draw(mesh_shapes())
    shape = draw(shapes(1, 3, 7))
    # Partial inputs: the shift of a sum is not the sum of shifts, so DTensor reduces them first
    placements = draw(placements_st(len(shape), len(mesh_shape), ("sum",)))
    amount = draw(st.integers(0, 8 * torch.tensor([], dtype=dtype).element_size() - 1))
    seed = draw(st.integers(0, 2**16))
    return op, dtype, shape, mesh_shape, placements, amount, seed


@pytest.mark.exhaustive  # the opt-in rules' property sweeps
@settings(PROPERTY, max_examples=200)
@given(shift_cases())
def test_shift_operators_property(case: tuple[Any, ...]) -> None:
    """W12: ``x >> k`` and ``x << k`` (a scalar or a tensor ``k``) equal plain torch on any placement."""
    op, dtype, shape, mesh_shape, placements, amount, seed = case
    h = harness()
    x = random_tensor(shape, dtype, seed, finite=True)
    k = torch.full(shape, amount, dtype=dtype)
    fn = {">>": lambda t: t >> amount, "<<": lambda t: t << amount,
          ">>t": lambda t, u: t >> u, "<<t": lambda t, u: t << u}[op]
    k_placements = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)  # x's layout
    args = [DArg(x, placements)] + ([DArg(k, k_placements)] if op.endswith("t") else [])
    with h.simulate():
        result = run_case(_named(fn, op), args, h.mesh(mesh_shape), seed=seed)
    assert result.ok and not result.skipped, result.error
    if not any(isinstance(p, Partial) for p in placements):
        assert result.total_comms == 0, result.comm_counts


# ====================================================== random ops, CPU meshes
RANDOM_OPS: dict[str, Callable[..., Any]] = {
    "rand_like": lambda t, **g: torch.rand_like(t),
    "randn_like": lambda t, **g: torch.randn_like(t),
    "randint_like": lambda t, **g: torch.randint_like(t, 3, 1000),
    "uniform_": lambda t, **g: t.uniform_(-1.0, 2.0, **g),
    "normal_": lambda t, **g: t.normal_(0.5, 2.0, **g),
    "bernoulli_": lambda t, **g: t.bernoulli_(0.3, **g),
    "dropout": lambda t, **g: torch.nn.functional.dropout(t, 0.5),
}
RANDOM_LAYOUTS = [((4,), (Shard(0),)), ((4,), (Replicate(),)), ((4,), (Shard(1),)),
                  ((2, 2), (Shard(0), Shard(1))), ((2, 2), (Shard(1), Shard(0))), ((2, 2), (Replicate(), Shard(0))),
                  ((2, 2), (Shard(0), Shard(0)))]


def _local_reference(full: torch.Tensor, mesh_shape: tuple[int, ...], placements: tuple[Placement, ...],
                     coordinate: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """A rank's shard of ``full`` and its shard index (row-major over tensor dims, each dim's index
    row-major over the mesh dims that shard it), written out."""
    local, index_by_dim, count_by_dim = full, [0] * full.ndim, [1] * full.ndim
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            local = chunk_shard(local, p.dim, mesh_shape[m], coordinate[m])
            index_by_dim[p.dim] = index_by_dim[p.dim] * mesh_shape[m] + coordinate[m]
            count_by_dim[p.dim] *= mesh_shape[m]
    index = 0
    for i, n in zip(index_by_dim, count_by_dim):
        index = index * n + i
    return local.clone(), index


@pytest.mark.parametrize("with_generator", [False, True], ids=["default", "generator"])
@pytest.mark.parametrize("mesh_shape,placements", RANDOM_LAYOUTS, ids=str)
@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_cpu_random_ops_draw_the_series_numbers(name: str, mesh_shape, placements, with_generator: bool) -> None:
    """Each shard holds torch's local op drawn after ``manual_seed(splitmix64(key, shard index) >> 1)``,
    ``key`` one int64 draw from the generator (the user's if passed); the default generator ends one
    draw further (none with a user generator)."""
    if with_generator and name not in ("uniform_", "normal_", "bernoulli_"):
        pytest.skip("the op takes no generator")
    op = RANDOM_OPS[name]
    h = harness()
    full = torch.zeros(6, 5, dtype=torch.int32 if name == "randint_like" else torch.float32)
    kwargs = lambda: {"generator": torch.Generator().manual_seed(5)} if with_generator else {}  # noqa: E731
    torch.manual_seed(11)
    with h.simulate():
        mesh = h.mesh(mesh_shape)
        out = op(make_dtensor(full, placements, mesh), **kwargs()).to_local()
        after = torch.rand(3)
        got = {r: (out._local_tensors[r], after._local_tensors[r]) for r in range(4)}
    for r in range(4):
        torch.manual_seed(11)
        gen = kwargs().get("generator")
        key = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, generator=gen))
        state_after_draw = torch.get_rng_state()
        local, index = _local_reference(full, mesh_shape, placements, rank_coordinate(mesh, r))
        torch.manual_seed(splitmix64(key, index) >> 1)
        expected = op(local)
        torch.set_rng_state(state_after_draw)
        assert torch.equal(got[r][0], expected), (r, got[r][0], expected)
        assert torch.equal(got[r][1], torch.rand(3)), r


@pytest.mark.parametrize("mesh_shape,placements", RANDOM_LAYOUTS, ids=str)
@pytest.mark.parametrize("factory", ["rand", "randn"])
def test_cpu_random_factories_draw_the_series_numbers(factory: str, mesh_shape, placements) -> None:
    """``torch.distributed.tensor.rand``/``randn`` on a CPU mesh (torch raised there): the same scheme."""
    import torch.distributed.tensor as dt

    h = harness()
    torch.manual_seed(13)
    with h.simulate():
        mesh = h.mesh(mesh_shape)
        out = getattr(dt, factory)((6, 5), device_mesh=mesh, placements=placements)
        got = {r: out.to_local()._local_tensors[r] for r in range(4)}
    assert out.shape == (6, 5) and out.placements == placements
    full = torch.empty(6, 5)
    for r in range(4):
        torch.manual_seed(13)
        key = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64))
        local, index = _local_reference(full, mesh_shape, placements, rank_coordinate(mesh, r))
        torch.manual_seed(splitmix64(key, index) >> 1)
        assert torch.equal(got[r], getattr(torch, factory)(local.shape)), r


def test_cpu_meshes_report_rng_support_and_seed_like_torch_manual_seed() -> None:
    """``is_rng_supported_mesh`` answers True for CPU meshes, and DTensor's ``manual_seed`` on one seeds
    every rank's CPU generator as ``torch.manual_seed`` does (torch warned and did nothing)."""
    from torch.distributed.tensor import _random as dtensor_random

    h = harness()
    with h.simulate():
        mesh = h.mesh((4,))
        assert dtensor_random.is_rng_supported_mesh(mesh)
        dtensor_random.manual_seed(21, mesh)
        drawn = torch.rand(3)
    torch.manual_seed(21)
    expected = torch.rand(3)
    assert all(torch.equal(drawn._local_tensors[r], expected) for r in range(4))


def test_cpu_random_ops_differ_across_shards_and_agree_on_replicas() -> None:
    h = harness()
    zeros = torch.zeros(8, 4)
    torch.manual_seed(3)
    with h.simulate():
        d = make_dtensor(zeros, (Shard(0), Replicate()), h.mesh((2, 2)))
        full = torch.randn_like(d).full_tensor()
        local = torch.randn_like(d).to_local()
        shards = {r: local._local_tensors[r] for r in range(4)}
    first, second = full._local_tensors[0].chunk(2)
    assert not torch.equal(first, second)
    assert torch.equal(shards[0], shards[1]) and torch.equal(shards[2], shards[3])
    assert not torch.equal(shards[0], shards[2])


@contextlib.contextmanager
def _logged(name: str) -> Iterator[list[logging.LogRecord]]:
    """The records ``name``'s logger emits inside the block (torch's loggers do not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_the_first_cpu_random_op_syncs_rank_0s_state_and_warns(monkeypatch) -> None:
    """Like torch's tracker when it is created: the first op sets every rank's CPU generator to rank 0's
    state (one broadcast), with torch's warning where they differed; later ops do not sync."""
    from torch.distributed._local_tensor import LocalTensor

    from torch.distributed.tensor import _random as dtensor_random

    from qstate.dtensor_rules import _compat, _cpu_random

    monkeypatch.setattr(dtensor_random, "_rng_tracker", None)  # as if no random op ran yet
    h = harness()
    zeros = torch.zeros(8)
    states = {r: torch.Generator().manual_seed(r).get_state() for r in range(4)}  # differing ranks
    with h.simulate():
        _compat.cpu_rng_states().set_rng_state(LocalTensor(states))
        d = make_dtensor(zeros, (Replicate(),), h.mesh((4,)))
        with _logged("torch.distributed.tensor._random") as records, CommDebugMode() as comm:
            first = torch.rand_like(d).to_local()
            second = torch.rand_like(d).to_local()
    assert comm.get_total_counts() == 1
    assert _cpu_random._RNG_STATE_SYNC_WARNING in [r.getMessage() for r in records]
    for r in range(1, 4):  # replicas agree once synced
        assert torch.equal(first._local_tensors[r], first._local_tensors[0])
        assert torch.equal(second._local_tensors[r], second._local_tensors[0])


def test_random_handlers_act_on_cpu_meshes_only() -> None:
    """Read from the installed tables: every op of ``OpDispatcher._random_ops`` has an entry keyed by
    mesh device type holding a rule for ``cpu`` only; any other mesh (CUDA-like) goes to torch's own
    entry or path, and its RNG tracker is never touched."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    random_ops = DTensor._op_dispatcher._random_ops
    assert random_ops
    for op in random_ops:
        entry = handlers[op]
        assert isinstance(entry, DeviceHandlers) and set(entry.handlers) == {"cpu"}, op
        assert entry.fallback is None, op  # torch had no handler: its own path
    random_entries = [o for o in rules.installed() if o.op in {str(op) for op in random_ops}]
    assert {o.device_type for o in random_entries} == {"cpu"}
    assert {o.table for o in random_entries} == {"_custom_op_handlers"}
    # the functions the series changes: each keeps torch's answer for any other device type
    from torch.distributed.tensor import _random as dtensor_random

    class _Mesh:
        device_type = "cuda"

    original = next(o for o in rules.installed() if o.op == "is_rng_supported_mesh")
    assert original.device_type == "cpu"
    assert dtensor_random.is_rng_supported_mesh(_Mesh()) == _torch_is_rng_supported_mesh(_Mesh())


def _torch_is_rng_supported_mesh(mesh: Any) -> bool:
    """torch's own answer (the function install() replaced)."""
    from torch.distributed.device_mesh import _get_device_handle

    handle = _get_device_handle(mesh.device_type)
    return bool(handle and hasattr(handle, "set_rng_state"))


def test_random_without_a_rule_keeps_torch_error() -> None:
    """``random_`` has no rule in torch nor in the series: install() leaves it torch's error (it no
    longer hands identical shards to every rank)."""
    h = harness()
    zeros = torch.zeros(8)
    with h.simulate():
        d = make_dtensor(zeros, (Shard(0),), h.mesh((4,)))
        with pytest.raises(NotImplementedError, match="random_"):
            d.random_(0, 2**16)


# ====================================================== foreach scalars tensor
@pytest.mark.parametrize("name", ["_foreach_addcdiv_", "_foreach_addcmul_", "_foreach_addcdiv", "_foreach_addcmul"])
@pytest.mark.parametrize("placements", [(Shard(0),), (Replicate(),)], ids=str)
def test_foreach_with_a_tensor_of_scalars(name: str, placements) -> None:
    """The four ``.Tensor`` overloads equal plain torch with no collective; a plain ``scalars`` needs no
    ``implicit_replication()`` (it is read on the host, as the kernels read it)."""
    op = getattr(torch, name)
    h = harness()
    fulls = [[random_tensor((7, 3), torch.float32, 10 * k + i, finite=True) + (3.0 if k == 2 else 0.0)
              for i in range(2)] for k in range(3)]
    scalars = torch.tensor([0.5, -0.25])
    expected = op(*[[t.clone() for t in ts] for ts in fulls], scalars)
    if name.endswith("_"):
        expected = [t.clone() for t in fulls[0]]
        op(expected, fulls[1], fulls[2], scalars)
    with h.simulate():
        mesh = h.mesh((4,))
        lists = [[make_dtensor(t, placements, mesh) for t in ts] for ts in fulls]
        with CommDebugMode() as comm:
            out = op(*lists, scalars)
        got = [t.full_tensor()._local_tensors[0] for t in (lists[0] if name.endswith("_") else out)]
    assert comm.get_total_counts() == 0
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


class TestForeachScalarsRefusals(expecttest.TestCase):
    def test_the_kernels_checks_hold(self) -> None:
        h = harness()
        ones = torch.ones(8)
        errors = []
        with h.simulate():
            lists = [[make_dtensor(ones, (Shard(0),), h.mesh((4,))) for _ in range(2)] for _ in range(3)]
            for scalars in (torch.ones(3), torch.tensor(1.0)):
                with pytest.raises(RuntimeError) as e:
                    torch._foreach_addcdiv_(*lists, scalars)
                errors.append(str(e.value))
        self.assertExpectedInline("\n".join(errors), """\
Expected length of scalars to match input of length 2 but got 3 instead.
Expected packed scalar Tensor to be of dimension 1. Got 0 instead.""")


# ================================================================ registry
def _dispatcher() -> Any:
    """The ``OpDispatcher`` DTensor dispatches through (torch's; the tables the rules write)."""
    return DTensor._op_dispatcher


def _propagator() -> Any:
    """The ``ShardingPropagator`` that owns DTensor's strategy tables."""
    return _dispatcher().sharding_propagator


def _clear_sharding_caches() -> None:
    """Drop torch's cached sharding decisions after a test edits DTensor's tables by hand."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()


_TABLES = {
    "op_strategy_funcs": _propagator,
    "op_single_dim_strategy_funcs": _propagator,
    "op_to_schema_info": _propagator,
    "op_to_schema_info_for_single_dim_strategy": _propagator,
    "op_to_rules": _propagator,
    "_custom_op_handlers": _dispatcher,
}

def _snapshot() -> dict[str, dict[Any, Any]]:
    return {name: dict(getattr(owner(), name)) for name, owner in _TABLES.items()}


def _same_tables(a: dict[str, dict[Any, Any]], b: dict[str, dict[Any, Any]]) -> bool:
    return all(
        a[t].keys() == b[t].keys() and all(a[t][k] is b[t][k] for k in a[t]) for t in a
    )


def test_install_uninstall_restore_tables_exactly(torch_rules: None) -> None:
    original = _snapshot()
    assert not rules.is_installed() and rules.installed() == []
    rules.install()
    once = _snapshot()
    rules.install()  # idempotent
    assert _same_tables(once, _snapshot())
    assert not _same_tables(original, once)
    prop = _propagator()
    # precedence: an op strategy only wins once the single-dim entry is gone
    assert aten.copy_.default not in prop.op_single_dim_strategy_funcs
    assert aten.copy_.default in prop.op_strategy_funcs
    assert prop.op_to_schema_info[aten.view.dtype].static_argnum == 1
    assert aten.view.dtype not in prop.op_single_dim_strategy_funcs
    report = {(o.op, o.table): o for o in rules.installed()}
    assert report[("aten.copy_.default", "op_single_dim_strategy_funcs")].action == "removed"
    assert all(o.reason for o in rules.installed())
    rules.uninstall()
    rules.uninstall()  # idempotent
    assert _same_tables(original, _snapshot())
    assert rules.installed() == []
def test_uninstall_leaves_foreign_entries_alone(torch_rules: None) -> None:
    rules.install()
    handlers = _dispatcher()._custom_op_handlers

    def foreign(*args: Any) -> None:
        return None

    handlers[aten.__rshift__.Scalar] = foreign
    try:
        with pytest.warns(UserWarning, match="changed by someone else"):
            rules.uninstall()
        assert handlers[aten.__rshift__.Scalar] is foreign
    finally:
        handlers.pop(aten.__rshift__.Scalar, None)



class TestInstalledOverrides(expecttest.TestCase):
    def test_installed_lists_every_override(self) -> None:
        # what install() changes in DTensor's tables: one line per entry, in the order of the series;
        # the lines whose table differs between torch 2.13 and 2.14 are left out
        by_version = ("aten.view.dtype", "aten.fill_.Scalar")
        lines = [f"{o.op} {o.table} {o.action} {o.device_type or ''}".rstrip() for o in rules.installed()
                 if o.op not in by_version]
        self.assertExpectedInline("\n".join(lines), """\
aten.fill_.Tensor op_strategy_funcs added
aten._to_copy.default op_single_dim_strategy_funcs replaced
aten.copy_.default op_single_dim_strategy_funcs removed
aten.copy_.default op_to_schema_info_for_single_dim_strategy removed
aten.copy_.default op_strategy_funcs added
aten.bernoulli.default _custom_op_handlers added cpu
aten.bernoulli_.float _custom_op_handlers added cpu
aten.native_dropout.default _custom_op_handlers added cpu
aten.normal_.default _custom_op_handlers added cpu
aten.rand.default _custom_op_handlers added cpu
aten.rand_like.default _custom_op_handlers added cpu
aten.randint_like.default _custom_op_handlers added cpu
aten.randint_like.low_dtype _custom_op_handlers added cpu
aten.randint_like.low_dtype_out _custom_op_handlers added cpu
aten.randn.default _custom_op_handlers added cpu
aten.randn_like.default _custom_op_handlers added cpu
aten.uniform_.default _custom_op_handlers added cpu
is_rng_supported_mesh torch.distributed.tensor._random replaced cpu
manual_seed torch.distributed.tensor._random replaced cpu
_dtensor_init_helper torch.distributed.tensor._api replaced cpu
aten._foreach_addcdiv_.Tensor _custom_op_handlers added
aten._foreach_addcmul_.Tensor _custom_op_handlers added
aten._foreach_addcdiv.Tensor _custom_op_handlers added
aten._foreach_addcmul.Tensor _custom_op_handlers added
aten.__rshift__.Scalar _custom_op_handlers added
aten.__rshift__.Tensor _custom_op_handlers added
aten.__lshift__.Scalar _custom_op_handlers added
aten.__lshift__.Tensor _custom_op_handlers added
aten.add.Tensor op_single_dim_strategy_funcs replaced
aten.add_.Tensor op_single_dim_strategy_funcs replaced
aten.add.out op_single_dim_strategy_funcs replaced
aten.sub.Tensor op_single_dim_strategy_funcs replaced
aten.sub_.Tensor op_single_dim_strategy_funcs replaced
aten.sub.out op_single_dim_strategy_funcs replaced
aten._foreach_add.List op_single_dim_strategy_funcs replaced
aten._foreach_add_.List op_single_dim_strategy_funcs replaced
aten._foreach_sub.List op_single_dim_strategy_funcs replaced
aten._foreach_sub_.List op_single_dim_strategy_funcs replaced
_partition_value torch.distributed.tensor.placement_types.Partial replaced""")


def test_toggling_clears_the_sharding_caches() -> None:
    """Same input, same op: the cached decision follows install/uninstall (C++ cache too)."""
    h = harness()
    full = random_tensor((4, 6), torch.float32, 3, finite=True)

    def placements() -> Any:
        with h.simulate():
            p = make_dtensor(full, (Partial("sum"),), h.mesh((4,)))
            try:
                return p.view(torch.int32).placements
            except RuntimeError as e:
                return "refused" if "Cannot view" in str(e) else e

    assert placements() == "refused"
    rules.uninstall()
    try:
        assert placements() == (Partial("sum"),)  # torch's rule again, not our cached plan
    finally:
        rules.install()
    assert placements() == "refused"


def _rule(op: Any, form: str) -> rules.Rule:
    return next(r for r in rules.RULES if r.op == op and r.form == form)


def test_install_leaves_torch_rules_that_have_the_fix(torch_rules: None) -> None:
    """On a torch whose own ``fill_`` and ``view.dtype`` rules already give the fixed result,
    ``install()`` writes nothing for those ops and lists them in ``not_needed()``."""
    prop = _propagator()
    fixed = {op: _rule(op, "strategy") for op in (aten.fill_.Scalar, aten.view.dtype)}
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_schema_info",
              "op_to_schema_info_for_single_dim_strategy")
    saved = {(t, op): getattr(prop, t).get(op) for t in tables for op in fixed}
    try:
        for op, rule in fixed.items():  # this torch, as if it shipped the fix as its own rule
            prop.op_single_dim_strategy_funcs.pop(op, None)
            prop.op_strategy_funcs[op] = rule.impl
            if rule.schema_info is not None:
                prop.op_to_schema_info[op] = rule.schema_info
        _clear_sharding_caches()
        rules.install()
        written = {o.op for o in rules.installed()}
        assert not {str(op) for op in fixed} & written
        assert {r.op for r in rules.not_needed()} >= set(fixed)
        assert "aten.fill_.Tensor" not in written and "aten.copy_.default" in written  # one patch: 0002
        for op, rule in fixed.items():
            assert prop.op_strategy_funcs[op] is rule.impl  # left as "torch" had it
        rules.uninstall()
        assert rules.not_needed() == []
    finally:
        rules.uninstall()
        for (t, op), entry in saved.items():
            table = getattr(prop, t)
            table.pop(op, None)
            if entry is not None:
                table[op] = entry
        _clear_sharding_caches()


def test_checks_recognize_the_installed_fixes() -> None:
    """With the rules installed (this module's fixture), every strategy rule's check finds its fix
    in DTensor's tables."""
    assert rules.is_installed()
    still = sorted({str(r.op) for r in rules.RULES if r.form != "handler" and r.needed()})
    assert still == [], still


def test_checks_recognize_the_installed_fixes() -> None:
    """With the rules installed, every rule that writes a strategy finds its fix in torch's answer."""
    assert rules.is_installed()
    still = sorted({str(r.op) for r in rules.RULES if r.form != "handler" and r.needed()})
    assert still == [], still


def test_a_check_that_cannot_run_raises_and_installs_nothing(torch_rules: None) -> None:
    """A feature check that cannot ask torch (here: it raises) makes install() raise, naming it,
    with DTensor's tables as they were: no guess that the rule is needed, or that it is not."""
    import dataclasses

    from qstate.dtensor_rules import _probe, _registry

    def broken_check() -> bool:
        raise AttributeError("ShardingPropagator has no propagate_op_sharding_non_cached")

    first, *rest = rules.RULES
    registry = _registry.Registry([*rest[:3], dataclasses.replace(first, needed=_probe.checked(broken_check))])
    before = {name: dict(getattr(_TABLES[name](), name)) for name in _TABLES}
    with pytest.raises(RuntimeError, match=r"the feature check .*broken_check cannot run on torch .*"
                                           r"AttributeError: ShardingPropagator has no .*; nothing installed"):
        registry.install()
    assert not registry.is_installed() and registry.installed() == []
    after = {name: dict(getattr(_TABLES[name](), name)) for name in _TABLES}
    assert after == before


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: a copy of PyTorch's DTensor test files; by default the shared folder beside the repository
_TORCH_TESTS_DIR = os.environ.get("QSTATE_TORCH_DTENSOR_TESTS",
                                  os.path.join(_ROOT, "..", "shared", "pytorch-dtensor-tests"))


def _run_python(code: str, *args: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-2000:]


_TABLES_BEFORE = """
    import sys
    import torch
    from torch.distributed.tensor import DTensor
    prop = DTensor._op_dispatcher.sharding_propagator
    names = ["op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_schema_info",
             "op_to_schema_info_for_single_dim_strategy", "op_to_rules"]
    tables = {n: getattr(prop, n) for n in names}
    tables["_custom_op_handlers"] = DTensor._op_dispatcher._custom_op_handlers
    before = {n: dict(t) for n, t in tables.items()}
"""

_TABLES_AFTER = """
    def changed(n):
        after, old = tables[n], before[n]
        return sorted(str(k) for k in after.keys() | old.keys()
                      if after.get(k, None) is not old.get(k, None))
"""


def test_import_changes_no_torch_op_rule() -> None:
    """A plain ``import qstate`` only adds entries for ``qstate::`` ops to DTensor's tables."""
    _run_python(
        _TABLES_BEFORE + """
    sys.path.insert(0, sys.argv[1])
    import qstate
    assert not qstate.dtensor_rules.is_installed() and qstate.dtensor_rules.installed() == []
""" + _TABLES_AFTER + """
    foreign = {n: [k for k in changed(n) if not k.startswith("qstate.")] for n in tables}
    assert not any(foreign.values()), foreign
    # every entry new (qstate's ops exist only once qstate is imported), one table each
    assert {n: changed(n) for n in tables if changed(n)} == {
        "_custom_op_handlers": ["qstate.flat_index_like.default"],
        "op_strategy_funcs": ["qstate.copy_with_draws_.default", "qstate.fused_update.default",
                              "qstate.stochastic_round_bf16.default"],
        "op_to_schema_info": ["qstate.fused_update.default"],
    }, {n: changed(n) for n in tables}
    print("ok")
""",
        _ROOT,
    )


def test_install_from_a_sitecustomize() -> None:
    """``import qstate.dtensor_rules as r; r.install()`` before anything else (a sitecustomize) installs
    the series, and a later ``import qstate`` keeps it."""
    _run_python(
        """
    import sys
    sys.path.insert(0, sys.argv[1])
    import qstate.dtensor_rules as r
    r.install()
    import qstate
    assert r.is_installed() and r.installed()
    print("ok")
""",
        _ROOT,
    )


def test_import_of_the_rules_package_has_no_side_effects() -> None:
    """``import qstate.dtensor_rules`` (without qstate/__init__) touches no DTensor table."""
    _run_python(
        _TABLES_BEFORE + """
    import os, types
    pkg = types.ModuleType("qstate"); pkg.__path__ = [os.path.join(sys.argv[1], "qstate")]
    sys.modules["qstate"] = pkg  # bypass qstate/__init__.py, which registers qstate's ops
    import qstate.dtensor_rules as r
    assert not r.is_installed() and r.installed() == []
""" + _TABLES_AFTER + """
    assert not any(changed(n) for n in tables), {n: changed(n) for n in tables}
    print("ok")
""",
        _ROOT,
    )

def test_rules_never_import_the_optimizers() -> None:
    """Arrows point down: no module of ``qstate.dtensor_rules`` imports ``qstate.optim``, at module
    level or inside a function (the optimizers call ``qstate::`` ops whose rules live here)."""
    import ast

    package = os.path.join(_ROOT, "qstate", "dtensor_rules")
    found = []
    for name in sorted(os.listdir(package)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(package, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = ("." * node.level) + (node.module or "")
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.startswith(("qstate.optim", "..optim")) or n == "qstate.optim" for n in names):
                found.append(f"{name}:{node.lineno}")
    assert found == []


#: PyTorch's own tests whose results the opt-in rules change (LocalTensor twins: one process)
_TORCH_TESTS_CHANGED_BY_OPT_IN = (
    "test_random_ops.py::DistTensorRandomInitTestWithLocalTensor::test_init_ops",  # rand_like on a CPU mesh
    "test_tensor_ops.py::DistTensorOpsTestWithLocalTensor::test_fill_inplace_partial_sum",  # fill_ keeps Partial
)


@pytest.mark.skipif(not os.path.isdir(_TORCH_TESTS_DIR), reason="no copy of PyTorch's DTensor tests "
                    "(set QSTATE_TORCH_DTENSOR_TESTS)")
def test_torch_dtensor_tests_pass_with_qstate_imported() -> None:
    """PyTorch's tests of the ops the opt-in rules change pass after a plain ``import qstate``."""
    _run_python(
        """
    import sys
    sys.path.insert(0, sys.argv[1])
    import pytest
    import qstate
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", sys.argv[2], *sys.argv[3:]])
    assert rc == 0 and not qstate.dtensor_rules.is_installed(), rc
    print("ok")
""",
        _ROOT, _TORCH_TESTS_DIR, *(os.path.join(_TORCH_TESTS_DIR, t) for t in _TORCH_TESTS_CHANGED_BY_OPT_IN),
    )
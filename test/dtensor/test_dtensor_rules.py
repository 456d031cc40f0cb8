"""qstate.dtensor_rules, checked with the DTensor harness (fake PG + LocalTensorMode).

* property tests (hypothesis, 500 cases per rule) compare every rule against
  plain torch on random meshes, placements (Partial included) and uneven shapes;
* the harness is shown to fail on torch 2.13's own rules (uninstalled state);
* collective counts are pinned with ``assertExpectedInline``;
* the stochastic-rounding bit sequence runs shard by shard with no collective;
* install / uninstall / installed() and the cache clearing are checked;
* ``import qstate`` changes no rule of a torch op (only ``qstate::`` entries),
  and PyTorch's own DTensor tests that the opt-in rules change pass with it.

The opt-in rules (:func:`qstate.dtensor_rules.install`) are installed for this
module by a fixture, and uninstalled after it.
"""

from __future__ import annotations

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
from torch.distributed.tensor import DTensor
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
    src, dst, shape, mesh_shape, placements, seed = case
    h = harness()
    finite = any(isinstance(p, Partial) for p in placements)
    full = random_tensor(shape, src, seed, finite=finite)
    with h.simulate():
        mesh = h.mesh(mesh_shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rules.UnrepresentableShardWarning)
            result = run_case(_view(dst), [DArg(full, placements)], mesh, seed=seed)
        assert result.ok, result.error
        if result.skipped:
            return
        needs_comm = _view_needs_comm(shape, src, dst, placements, mesh)
        assert (result.total_comms > 0) == needs_comm, (case, result.comm_counts)
        assert set(result.comm_counts) <= {
            "c10d_functional.all_reduce",
            "c10d_functional.all_gather_into_tensor",
        }, result.comm_counts


REQUIRED_PLACEMENTS = [
    ((4,), (Replicate(),)),
    ((4,), (Shard(0),)),
    ((4,), (Shard(1),)),
    ((4,), (Partial("sum"),)),
    ((4,), (Partial("max"),)),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Shard(1), Shard(1))),
    ((2, 2), (Replicate(), Shard(1))),
    ((2, 2), (Partial("sum"), Shard(0))),
]


@pytest.mark.parametrize("src,dst", REQUIRED_PAIRS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(8, 16), (7, 12)], ids=str)  # even, uneven
@pytest.mark.parametrize("mesh_shape,placements", REQUIRED_PLACEMENTS, ids=str)
def test_view_dtype_required_pairs(src, dst, shape, mesh_shape, placements) -> None:
    h = harness()
    full = random_tensor(shape, src, 7, finite=True)
    with h.simulate():
        mesh = h.mesh(mesh_shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rules.UnrepresentableShardWarning)
            result = run_case(_view(dst), [DArg(full, placements)], mesh)
        assert result.ok and not result.skipped, result.error
        assert (result.total_comms > 0) == _view_needs_comm(shape, src, dst, placements, mesh)


def test_view_dtype_dtype_is_in_cache_key() -> None:
    """W1: a second view of the same input to another dtype is not served from cache."""
    h = harness()
    full = random_tensor((8, 6), torch.float32, 1)
    with h.simulate():
        d = make_dtensor(full, (Shard(0),), h.mesh((4,)))
        a, b, c = d.view(torch.int32), d.view(torch.int16), d.view(torch.uint8)
        assert (a.shape, a.dtype) == ((8, 6), torch.int32)
        assert (b.shape, b.dtype) == ((8, 12), torch.int16)
        assert (c.shape, c.dtype) == ((8, 24), torch.uint8)
        for t, dt in ((a, torch.int32), (b, torch.int16), (c, torch.uint8)):
            assert torch.equal(t.full_tensor()._local_tensors[3], full.view(dt))


def test_view_dtype_unrepresentable_shard_warns_and_redistributes() -> None:
    """W3/E4: f32 -> i16 with an uneven last-dim shard: [3,3,3,1] * 2 != chunk(20)."""
    h = harness()
    full = random_tensor((4, 10), torch.float32, 2)
    with h.simulate():
        d = make_dtensor(full, (Shard(1),), h.mesh((4,)))
        with pytest.warns(rules.UnrepresentableShardWarning, match=r"\[3, 3, 3, 1\]"):
            out = d.view(torch.int16)
        assert out.placements == (Replicate(),)
        assert torch.equal(out.full_tensor()._local_tensors[0], full.view(torch.int16))
        # an even split is representable: no warning, no communication
        d2 = make_dtensor(random_tensor((4, 16), torch.float32, 3), (Shard(1),), h.mesh((4,)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", rules.UnrepresentableShardWarning)
            with CommDebugMode() as comm:
                out2 = d2.view(torch.int16)
        assert out2.placements == (Shard(1),) and comm.get_total_counts() == 0
        assert out2._local_tensor._local_tensors[1].shape == (4, 8)


def test_view_dtype_partial_rejected_when_communication_is_forbidden() -> None:
    """W2: Partial must be reduced first; under forbid_implicit_communication that is an error."""
    h = harness()
    full = random_tensor((4, 6), torch.float32, 3, finite=True)
    with h.simulate():
        mesh = h.mesh((4,))
        p = make_dtensor(full, (Partial("sum"),), mesh)
        with pytest.raises(rules.ImplicitCommunicationError, match="bits of a reduction"):
            with rules.forbid_implicit_communication():
                p.view(torch.int32)
        # Shard/Replicate never communicate, so they are fine in such a region
        with rules.forbid_implicit_communication():
            s = make_dtensor(full, (Shard(0),), mesh).view(torch.int32)
        assert s.placements == (Shard(0),)
        out = p.view(torch.int32)
        assert out.placements == (Replicate(),)
        assert torch.equal(out.full_tensor()._local_tensors[2], full.view(torch.int32))
        # the identity view keeps the Partial (no reduction needed)
        assert p.view(torch.float32).placements == (Partial("sum"),)


def _comm_summary(op: Callable[[Any], Any], full: torch.Tensor, mesh_shape, placements) -> str:
    h = harness()
    with h.simulate():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rules.UnrepresentableShardWarning)
            result = run_case(op, [DArg(full, placements)], h.mesh(mesh_shape))
    assert result.ok, result.error
    return f"{result.output_placements} {dict(sorted(result.comm_counts.items()))}"


class TestViewDtypeCollectives(expecttest.TestCase):
    """Pinned collective counts: zero for Shard/Replicate, the redistribute for Partial."""

    def test_shard_and_replicate(self) -> None:
        x = random_tensor((8, 16), torch.float32, 11, finite=True)
        s = _comm_summary(_view(torch.int32), x, (4,), (Shard(0),))
        self.assertExpectedInline(s, """(Shard(dim=0),) {}""")
        s = _comm_summary(_view(torch.int16), x, (4,), (Shard(1),))
        self.assertExpectedInline(s, """(Shard(dim=1),) {}""")
        s = _comm_summary(_view(torch.int32), x, (4,), (Replicate(),))
        self.assertExpectedInline(s, """(Replicate(),) {}""")
        s = _comm_summary(_view(torch.uint8), x, (2, 2), (Shard(1), Shard(0)))
        self.assertExpectedInline(s, """(Shard(dim=1), Shard(dim=0)) {}""")

    def test_partial(self) -> None:
        x = random_tensor((8, 16), torch.float32, 12, finite=True)
        s = _comm_summary(_view(torch.int32), x, (4,), (Partial("sum"),))
        self.assertExpectedInline(s, """(Replicate(),) {'c10d_functional.all_reduce': 1}""")
        s = _comm_summary(_view(torch.int32), x, (4,), (Partial("max"),))
        self.assertExpectedInline(s, """(Replicate(),) {'c10d_functional.all_reduce': 1}""")
        s = _comm_summary(_view(torch.int16), x, (2, 2), (Shard(0), Partial("sum")))
        self.assertExpectedInline(
            s, """(Shard(dim=0), Replicate()) {'c10d_functional.all_reduce': 1}"""
        )

    def test_unrepresentable_shard(self) -> None:
        x = random_tensor((4, 10), torch.float32, 13)
        s = _comm_summary(_view(torch.int16), x, (4,), (Shard(1),))
        self.assertExpectedInline(
            s, """(Replicate(),) {'c10d_functional.all_gather_into_tensor': 1}"""
        )


# ================================================================ random ops
RANDINT_DTYPES = [
    torch.int64, torch.int32, torch.int16, torch.uint8,
    torch.float32, torch.bfloat16, torch.float64,
]
RANDOM_KINDS = [
    "randint_like", "randint_like_high", "rand_like", "random_", "random_from", "random_to",
]
# highest exclusive bound whose integers the dtype holds exactly
_RANDINT_TOP = {
    torch.uint8: 256, torch.bfloat16: 256, torch.int16: 2**15, torch.int8: 128, torch.float16: 2049,
}
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def random_cases(draw: Any) -> tuple[Any, ...]:
    kind = draw(st.sampled_from(RANDOM_KINDS))
    if kind == "rand_like":
        dtype = draw(st.sampled_from(FLOAT_DTYPES))
    elif kind.startswith("random_"):
        dtype = draw(st.sampled_from(RANDINT_DTYPES + [torch.int8, torch.float16]))
    else:
        dtype = draw(st.sampled_from(RANDINT_DTYPES))
    top = _RANDINT_TOP.get(dtype, 2**31)
    low = draw(st.integers(0, 16))
    high = draw(st.integers(low + 1, top))
    mesh_shape = draw(mesh_shapes())
    shape = draw(shapes(0, 3, 9))
    placements = draw(placements_st(len(shape), len(mesh_shape), _reduce_ops_for(dtype)))
    seed = draw(st.integers(0, 2**31))
    return kind, dtype, low, high, shape, mesh_shape, placements, seed


def _random_op(kind: str, low: int, high: int, seed: int, positional: bool) -> Callable[[Any], Any]:
    """The op on DTensors (torch API, through the handlers) or its plain reference."""

    def g() -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    torch_api: dict[str, Callable[[Any], Any]] = {
        "randint_like": lambda t: torch.randint_like(t, low, high, generator=g()),
        "randint_like_high": lambda t: torch.randint_like(t, high, generator=g()),
        "rand_like": lambda t: torch.rand_like(t, generator=g()),
        "random_": lambda t: t.random_(generator=g()),
        "random_from": lambda t: t.random_(low, high, generator=g()),
        "random_to": lambda t: t.random_(high, generator=g()),
    }
    plain: dict[str, Callable[[Any], Any]] = {
        "randint_like": lambda t: rules.positional_randint_like(t, low, high, generator=g()),
        "randint_like_high": lambda t: rules.positional_randint_like(t, high, generator=g()),
        "rand_like": lambda t: rules.positional_rand_like(t, generator=g()),
        "random_": lambda t: rules.positional_random_(t, generator=g()),
        "random_from": lambda t: rules.positional_random_(t, low, high, generator=g()),
        "random_to": lambda t: rules.positional_random_(t, 0, high, generator=g()),
    }
    return _named((plain if positional else torch_api)[kind], kind)


@pytest.mark.exhaustive  # the opt-in rules' property sweeps
@PROPERTY
@given(random_cases())
def test_random_ops_property(case: tuple[Any, ...]) -> None:
    """Every shard equals the same slice of the positional stream; no collectives."""
    kind, dtype, low, high, shape, mesh_shape, placements, seed = case
    h = harness()
    full = random_tensor(shape, dtype, seed, finite=True)
    with h.simulate():
        result = run_case(
            _random_op(kind, low, high, seed, positional=False),
            [DArg(full, placements)],
            h.mesh(mesh_shape),
            reference=_random_op(kind, low, high, seed, positional=True),
        )
    assert result.ok and not result.skipped, result.error
    assert result.total_comms == 0, result.comm_counts
    assert result.output_placements == tuple(
        Replicate() if isinstance(p, Partial) else p for p in placements
    )


def test_random_shards_independent_replicas_agree_and_seeded() -> None:
    """W11: Shard(0) shards get different numbers; Replicate ranks agree; seeds reproduce."""
    h = harness()
    full = torch.zeros(8, 32, dtype=torch.int32)
    fullf = full.float()
    with h.simulate() as lm:
        d = make_dtensor(full, (Shard(0),), h.mesh((4,)))
        r = torch.randint_like(d, 0, 1 << 16)
        shards = [r._local_tensor._local_tensors[k] for k in range(4)]
        assert all(not torch.equal(shards[0], s) for s in shards[1:])
        d2 = make_dtensor(full, (Replicate(), Shard(0)), h.mesh((2, 2)))
        r2 = torch.randint_like(d2, 0, 1 << 16)
        loc = r2._local_tensor._local_tensors
        assert torch.equal(loc[0], loc[2]) and torch.equal(loc[1], loc[3])
        assert not torch.equal(loc[0], loc[1])
        # default generator: torch.manual_seed reproduces, and matches the plain stream
        torch.manual_seed(1234)
        a = torch.rand_like(make_dtensor(fullf, (Shard(1),), h.mesh((4,)))).full_tensor()
        torch.manual_seed(1234)
        b = torch.rand_like(make_dtensor(fullf, (Shard(0),), h.mesh((4,)))).full_tensor()
        c = torch.rand_like(make_dtensor(fullf, (Shard(0),), h.mesh((4,)))).full_tensor()
        assert torch.equal(a._local_tensors[0], b._local_tensors[3])
        assert not torch.equal(b._local_tensors[0], c._local_tensors[0])
        with lm.disable():
            torch.manual_seed(1234)
            ref = rules.positional_rand_like(fullf)
        assert torch.equal(a._local_tensors[1], ref)


def test_positional_stream_is_splitmix64_and_in_range() -> None:
    mask = (1 << 64) - 1
    # the raw stream: randint over the whole int64 range adds its low end to each output (mod 2**64), under
    # the key that one random_() of an int64 scalar draws from the generator
    for seed in (0, 1, 2):
        key = int(torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(seed)))
        got = rules.positional_randint_like(torch.empty(257, dtype=torch.int64), -(2**63), 2**63,
                                            generator=torch.Generator().manual_seed(seed)).tolist()
        assert [(v + 2**63) & mask for v in got] == [splitmix64(key, i) for i in range(257)]
    # the same reference gives the parameters' stochastic-rounding keys (rounding_keys.param_keys), which
    # test_cpu_kernel.py's rounding checks compare the C kernel's draws with

    g = torch.Generator().manual_seed(0)
    u = rules.positional_rand_like(torch.empty(20000), generator=g)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.01
    assert rules.positional_rand_like(torch.empty(4096, dtype=torch.bfloat16)).max() < 1
    r = rules.positional_randint_like(torch.empty(20000, dtype=torch.int32), -3, 5)
    assert r.dtype == torch.int32 and set(r.unique().tolist()) == set(range(-3, 5))
    assert rules.positional_random_(torch.empty(4096, dtype=torch.uint8)).max() > 200
    assert rules.positional_random_(torch.empty(4096, dtype=torch.bool)).sum() > 1000
    f = rules.positional_random_(torch.empty(4096))
    assert f.min() >= 0 and f.max() <= 2**24 and torch.equal(f, f.round())
    full64 = rules.positional_random_(torch.empty(4096, dtype=torch.int64), -(2**63), None)
    assert full64.min() < -(2**60) and full64.max() > 2**60
    with pytest.raises(RuntimeError, match="out of bounds"):  # as torch.randint_like
        rules.positional_randint_like(torch.empty(3, dtype=torch.uint8), 0, 1000)


# ===================================================== stochastic rounding
def stochastic_round_bf16(x: Any, randint_like: Callable[..., Any]) -> Any:
    """fp32 -> bf16 rounding up with probability (low 16 bits) / 2**16."""
    bits = x.view(torch.int32)
    low = bits & 0xFFFF
    high = bits & -65536
    rnd = randint_like(bits, 0, 0x10000)
    rounded = torch.where(rnd < low, high + 0x10000, high)
    return rounded.view(torch.float32).bfloat16()


SR_LAYOUTS = [
    ((4,), (Replicate(),)),
    ((4,), (Shard(0),)),
    ((4,), (Shard(1),)),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Replicate(), Shard(0))),
    ((2, 2), (Shard(1), Shard(1))),
    ((2, 2), (Shard(0), Replicate())),
]


@pytest.mark.parametrize("shape", [(8, 16), (7, 10), (5, 9), (3, 2)], ids=str)
@pytest.mark.parametrize("mesh_shape,placements", SR_LAYOUTS, ids=str)
def test_stochastic_rounding_sequence(shape, mesh_shape, placements) -> None:
    h = harness()
    full = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 3
    with h.simulate() as lm:
        mesh = h.mesh(mesh_shape)
        d = make_dtensor(full, placements, mesh)
        g = torch.Generator().manual_seed(77)
        with CommDebugMode() as comm:
            out = stochastic_round_bf16(
                d, lambda t, lo, hi: torch.randint_like(t, lo, hi, generator=g)
            )
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert out.placements == placements and out.dtype == torch.bfloat16
        with lm.disable():
            g_ref = torch.Generator().manual_seed(77)
            want = stochastic_round_bf16(
                full, lambda t, lo, hi: rules.positional_randint_like(t, lo, hi, generator=g_ref)
            )
            # sanity: every value is the truncation or the next bf16 away from zero
            trunc = full.view(torch.int32) & -65536
            bits = want.float().view(torch.int32)
            assert torch.all((bits == trunc) | (bits == trunc + 0x10000))
            for rank in range(4):
                coord = rank_coordinate(mesh, rank)
                shard = want
                for m, p in enumerate(placements):
                    if isinstance(p, Shard):
                        shard = chunk_shard(shard, p.dim, mesh.size(m), coord[m])
                got = out._local_tensor._local_tensors[rank]
                assert torch.equal(got.view(torch.int16), shard.contiguous().view(torch.int16))
        whole = out.full_tensor()._local_tensors[0]
        assert torch.equal(whole.view(torch.int16), want.view(torch.int16))


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
        # torch's own copy_ of out-of-range floats into integers is undefined: compare placements only
        assert result.output_placements == (Replicate(),)
        return
    assert result.ok and not result.skipped, result.error
    commutes = dst_dtype.is_floating_point or (
        torch.iinfo(dst_dtype).min <= torch.iinfo(src_dtype).min
        and torch.iinfo(src_dtype).max <= torch.iinfo(dst_dtype).max)
    assert result.output_placements == ((partial,) if commutes else (Replicate(),))


INT_DTYPES = [torch.int32, torch.int64, torch.int16, torch.uint8]
_INPLACE_ERROR = "in-place operations that require placement changes are not supported"


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
    if not result.ok and op.endswith("_") and _INPLACE_ERROR in result.error:
        # loud, never wrong: an int Partial self cannot absorb the operand in place,
        # and torch 2.13 cannot bring a Replicate operand to an uneven Shard self
        return
    assert result.ok, result.error


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


# ================================================= torch's own rules (2.13)
def test_harness_flags_torch_rules(torch_rules: None) -> None:
    """Against torch 2.13's own tables the harness reports each known bug."""
    h = harness()
    x = random_tensor((8, 6), torch.float32, 1)
    x_uneven = random_tensor((4, 10), torch.float32, 2)
    xp = random_tensor((4, 6), torch.float32, 3, finite=True)
    xi = random_tensor((4, 6), torch.int32, 4)
    zeros_i, zeros_f = torch.zeros(16, 4, dtype=torch.int32), torch.zeros(8)
    add = _named(lambda a, b: a + b, "add")
    copy_ = _named(lambda a, b: a.copy_(b), "copy_")
    fill_ = _named(lambda t: t.fill_(3.0), "fill_")
    randint, randint_ref = (_random_op("randint_like", 0, 1000, 5, p) for p in (False, True))
    xi64 = torch.arange(24, dtype=torch.int64).view(4, 6)
    rshift = _named(lambda t: t >> 2, "__rshift__")
    P, R, S0, S1 = Partial("sum"), Replicate(), Shard(0), Shard(1)
    found = {}
    with h.simulate():
        m1, m2 = h.mesh((4,)), h.mesh((2, 2))
        cases = [
            # (name, op, args, mesh, reference); W1 needs the warm-up right before it
            ("W1 warm-up", _view(torch.int32), [DArg(x, (S0,))], m1, None),
            ("W1", _view(torch.int16), [DArg(x, (S0,))], m1, None),
            ("W2 Partial(sum)", _view(torch.int32), [DArg(xp, (P,))], m1, None),
            ("W2 Partial(max)", _view(torch.int32), [DArg(xp, (S1, Partial("max")))], m2, None),
            ("W3 uneven last dim", _view(torch.int16), [DArg(x_uneven, (S1,))], m1, None),
            ("W11 randint_like", randint, [DArg(zeros_i, (S0,))], m1, randint_ref),
            ("W5 int Partial + Replicate", add, [DArg(xi, (P,)), DArg(xi, (R,))], m1, None),
            ("W6 fill_ Partial", fill_, [DArg(xp, (P,))], m1, None),
            ("W9 copy_ into int Partial", copy_, [DArg(xi, (P,)), DArg(xi, (R,))], m1, None),
            ("W12 >> returns its input", rshift, [DArg(xi64, (S0,))], m1, None),
        ]
        for name, op, args, mesh, ref in cases:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found[name] = not run_case(op, args, mesh, reference=ref).ok
        # aten.random_ has no strategy at all
        with pytest.raises(NotImplementedError, match="random_"):
            make_dtensor(zeros_f, (S0,), m1).random_(0, 10)
        # a sweep of the view.dtype property over the required pairs fails too
        sweep_failures = 0
        for i, (src, dst) in enumerate(REQUIRED_PAIRS):
            full = random_tensor((5, 12), src, i, finite=True)
            for mesh, pl in ((m1, (S1,)), (m1, (P,)), (m2, (S1, S0))):
                sweep_failures += not run_case(_view(dst), [DArg(full, pl)], mesh).ok
    assert found == {name: name != "W1 warm-up" for name, *_ in cases}
    assert sweep_failures >= 10


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


class TestInstalledOverrides(expecttest.TestCase):
    def test_installed_lists_every_override(self) -> None:
        # what install() changes in DTensor's tables: one line per table entry, in the order of RULES,
        # each with a reason (checked in test_install_uninstall_restore_tables_exactly)
        lines = [f"{o.op} {o.table} {o.action}" for o in rules.installed()]
        by_version = ("aten.view.dtype ", "aten.fill_.Scalar ")
        self.assertExpectedInline("\n".join(line for line in lines if not line.startswith(by_version)), """\
aten.randint_like.default _custom_op_handlers added
aten.randint_like.low_dtype _custom_op_handlers added
aten.randint_like.generator _custom_op_handlers added
aten.randint_like.low_generator_dtype _custom_op_handlers added
aten.rand_like.default _custom_op_handlers added
aten.rand_like.generator _custom_op_handlers added
aten.random_.default _custom_op_handlers added
aten.random_.from _custom_op_handlers added
aten.random_.to _custom_op_handlers added
aten.randint_like.generator op_strategy_funcs added
aten.randint_like.generator op_to_schema_info added
aten.randint_like.low_generator_dtype op_strategy_funcs added
aten.randint_like.low_generator_dtype op_to_schema_info added
aten.rand_like.generator op_strategy_funcs added
aten.rand_like.generator op_to_schema_info added
aten.random_.default op_strategy_funcs added
aten.random_.from op_strategy_funcs added
aten.random_.to op_strategy_funcs added
aten.fill_.Tensor op_strategy_funcs added
aten.copy_.default op_single_dim_strategy_funcs removed
aten.copy_.default op_to_schema_info_for_single_dim_strategy removed
aten.copy_.default op_strategy_funcs added
aten.add.Tensor op_single_dim_strategy_funcs replaced
aten.add_.Tensor op_single_dim_strategy_funcs replaced
aten.add.out op_single_dim_strategy_funcs replaced
aten.sub.Tensor op_single_dim_strategy_funcs replaced
aten.sub_.Tensor op_single_dim_strategy_funcs replaced
aten.sub.out op_single_dim_strategy_funcs replaced
aten.__rshift__.Scalar _custom_op_handlers added
aten.__rshift__.Tensor _custom_op_handlers added
aten.__lshift__.Scalar _custom_op_handlers added
aten.__lshift__.Tensor _custom_op_handlers added""")
        # torch 2.14 keeps view.dtype's and fill_.Scalar's strategies in the single-dim table, 2.13 in the
        # op strategy table
        moved = "\n".join(line for line in lines if line.startswith(by_version))
        if torch.torch_version.TorchVersion(torch.__version__) >= (2, 14):
            self.assertExpectedInline(moved, """\
aten.view.dtype op_single_dim_strategy_funcs removed
aten.view.dtype op_strategy_funcs added
aten.view.dtype op_to_schema_info added
aten.fill_.Scalar op_single_dim_strategy_funcs removed
aten.fill_.Scalar op_strategy_funcs added""")
        else:
            self.assertExpectedInline(moved, """\
aten.view.dtype op_strategy_funcs replaced
aten.view.dtype op_to_schema_info added
aten.fill_.Scalar op_strategy_funcs replaced""")


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
    report = {(o.op, o.table): o for o in rules.installed()}
    # torch <= 2.6 had no view.dtype strategy, 2.7-2.13 one in op_strategy_funcs (replaced), 2.14
    # one in op_single_dim_strategy_funcs (removed there, so that the added op strategy wins)
    torch_view = [t for t in ("op_strategy_funcs", "op_single_dim_strategy_funcs") if aten.view.dtype in original[t]]
    view_action = "replaced" if "op_strategy_funcs" in torch_view else "added"
    assert report[("aten.view.dtype", "op_strategy_funcs")].action == view_action
    if "op_single_dim_strategy_funcs" in torch_view:
        assert report[("aten.view.dtype", "op_single_dim_strategy_funcs")].action == "removed"
    assert aten.view.dtype not in prop.op_single_dim_strategy_funcs
    assert report[("aten.random_.default", "op_strategy_funcs")].action == "added"
    assert report[("aten.copy_.default", "op_single_dim_strategy_funcs")].action == "removed"
    assert all(o.reason for o in rules.installed())
    rules.uninstall()
    rules.uninstall()  # idempotent
    assert _same_tables(original, _snapshot())
    assert rules.installed() == []


def test_version_gate_adds_view_dtype_rule_when_torch_has_none(torch_rules: None) -> None:
    """torch <= 2.6 had no view.dtype strategy: the rule is then added, and removed again."""
    prop = _propagator()
    # torch's own entry, wherever this torch keeps it (2.14: the single-dim table)
    tables = (prop.op_strategy_funcs, prop.op_single_dim_strategy_funcs)
    saved = [(table, table.pop(aten.view.dtype)) for table in tables if aten.view.dtype in table]
    assert saved
    try:
        rules.install()
        actions = {o.table: o.action for o in rules.installed() if o.op == "aten.view.dtype"}
        assert actions["op_strategy_funcs"] == "added"
        rules.uninstall()
        assert aten.view.dtype not in prop.op_strategy_funcs
    finally:
        rules.uninstall()
        for table, entry in saved:
            table[aten.view.dtype] = entry
        _clear_sharding_caches()


def test_toggling_clears_the_sharding_caches() -> None:
    """Same input, same op: the cached decision must follow install/uninstall (C++ cache too)."""
    h = harness()
    full = random_tensor((4, 6), torch.float32, 3, finite=True)

    def run() -> tuple[Any, int]:
        with h.simulate():
            p = make_dtensor(full, (Partial("sum"),), h.mesh((4,)))
            with CommDebugMode() as comm:
                out = p.view(torch.int32)
            return out.placements, comm.get_total_counts()

    assert run() == ((Replicate(),), 1)
    rules.uninstall()
    try:
        assert run() == ((Partial("sum"),), 0)  # torch's rule again, not our cached plan
    finally:
        rules.install()
    assert run() == ((Replicate(),), 1)


def test_uninstall_leaves_foreign_entries_alone(torch_rules: None) -> None:
    rules.install()
    handlers = _dispatcher()._custom_op_handlers

    def foreign(*args: Any) -> None:
        return None

    handlers[aten.random_.default] = foreign
    try:
        with pytest.warns(UserWarning, match="changed by someone else"):
            rules.uninstall()
        assert handlers[aten.random_.default] is foreign
    finally:
        handlers.pop(aten.random_.default, None)


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
        assert "aten.fill_.Tensor" in written and "aten.copy_.default" in written
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


@pytest.mark.skipif(not os.path.isdir(_TORCH_TESTS_DIR), reason="no copy of PyTorch's DTensor tests")
def test_install_on_the_patched_torch_leaves_what_the_series_fixes() -> None:
    """``upstream/check`` applies the patch series to a copy of this torch's DTensor: there
    ``install()`` leaves torch's rules for view.dtype (0001), random ops (0002) and fill_ (0003)."""
    out = subprocess.run([sys.executable, os.path.join(_ROOT, "upstream", "check"), "--rules-only",
                          "--tests-dir", _TORCH_TESTS_DIR], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    if "SKIP" in out.stdout:
        pytest.skip(f"the series does not apply whole to torch {torch.__version__}")
    left = {line.split(":")[0].strip(): line.split("leaves torch's own for: ")[1]
            for line in out.stdout.splitlines() if line.strip().startswith(("unpatched", "patched"))}
    for fixed in ("view.dtype (strategy)", "fill_.Scalar (strategy)", "fill_.Tensor (strategy)",
                  "rand_like.default (handler)", "random_.default (handler)"):
        assert fixed in left["patched"] and fixed not in left["unpatched"], (fixed, left)
    # random_ has no rule in the series: on the patched torch install() leaves it torch's error (its
    # strategy alone would let every rank draw the same numbers); unpatched, install() draws by position
    assert left["unpatched"].endswith("random_: independent shards"), left
    assert left["patched"].endswith("random_: raises NotImplementedError"), left
    assert "random_.from (strategy)" in left["patched"], left


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

#!/usr/bin/env python
"""Op audit of DTensor's sharding rules: ops x input placements x dtypes against plain torch.

Usage (from the repository root, with the ``python`` of the env whose torch is audited)::

    python upstream/audit.py                 # torch's rules as they are (plain or overlay torch)
    python upstream/audit.py --install       # with qstate.dtensor_rules.install() applied
    python upstream/audit.py --slice fast    # the pytest slice (test/dtensor/test_dtensor_audit.py)
    python upstream/audit.py --json out.json # every case's outcome, for comparing two runs

Every case runs in one process on simulated ranks: ``init_process_group("fake",
rank=0, world_size=4)`` and ``LocalTensorMode(4)`` on a 1-D CPU mesh of 4.  The
case table is data (:data:`OPS`, :data:`LAYOUTS`, :data:`DTYPES`): an op is a
function of its DTensor input(s), the dtypes it is legal for, and how its result is
judged.  Inputs are built by ``dtensor_harness.make_dtensor`` (``torch.chunk``
shards; ``Partial`` inputs split so that their reduction is exact), from full
tensors of 6 x 16 (``S(0)``: rows 2, 2, 2, 0; ``S(-1) even``: 4 columns each),
6 x 10 (``S(-1) uneven``: 3, 3, 3, 1 columns), times the width ratio for a
``view`` to a wider dtype.

Each case is one of:

* ``right``: the DTensor result (every rank's ``full_tensor()``, and each local
  shard's shape against its spec) equals the plain op on the full tensor, bit
  for bit (within a few epsilons for float reductions and float add/sub with a
  ``Partial`` input, whose pieces round on their own);
* ``raises``: DTensor refused the case with an exception (a clear refusal);
* ``wrong``: the op returned and the result differs: silently wrong;
* ``n/a``: not a case: the plain op raises on the full tensor, or the input
  layout cannot hold the value exactly (``Partial(avg)`` of integers, ``Partial``
  of ``bool``).

Float-to-integer casts run on full values the target dtype holds (an out-of-range
cast is undefined); the pieces of a ``Partial`` input still take any value.

Cases run in one process, in table order, so a sharding decision cached for one
case (the cache key of ``view(dtype)``) is seen by the next, as in a program.

Random ops have no reference value; a random case is right when the output has
the plain op's shape and dtype, is not ``Partial``, every rank sees the same full
tensor, its values are in the op's range, the shards of a sharded output differ
from one another, and the same seed gives the same numbers.  Their JSON record
holds a digest of the numbers, so that two runs (``install()`` and the patched
torch) can be compared draw for draw.

Cases torch gets wrong for a reason recorded as an upstream issue are
:data:`KNOWN_WRONG`: they count as ``wrong (known)`` with the issue named, and
the exit status is 1 only for other wrong cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "test"))

from dtensor_harness import bits_equal, expected_local_shape, make_dtensor, random_tensor  # noqa: E402
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.experimental import implicit_replication  # noqa: E402
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard  # noqa: E402

WORLD_SIZE = 4
ROWS = 6


# ------------------------------------------------------------------ the table
@dataclasses.dataclass(frozen=True)
class Layout:
    """An input placement and the number of columns of the full tensor (before any width ratio)."""

    name: str
    placement: Placement
    cols: int = 16


LAYOUTS = (
    Layout("S(0)", Shard(0)),
    Layout("S(-1) even", Shard(1)),
    Layout("S(-1) uneven", Shard(1), cols=10),
    Layout("R", Replicate()),
    Layout("P(sum)", Partial("sum")),
    Layout("P(avg)", Partial("avg")),
    Layout("P(max)", Partial("max")),
    Layout("P(min)", Partial("min")),
)

FLOATS = (torch.float32, torch.bfloat16)
INTS = (torch.int32, torch.uint8, torch.int64)
DTYPES = FLOATS + INTS + (torch.bool,)


@dataclasses.dataclass(frozen=True)
class Op:
    """One row of the audit.

    ``fn`` takes the input (a DTensor, or the full tensor for the reference) and
    returns the result; ``others`` builds further tensor arguments from the input's
    full value, each with the placement it gets for a given input placement.
    ``check`` is ``"exact"`` (bits), ``"close"`` (float reductions) or the name of a
    random-op range (see :data:`RANGES`).
    """

    name: str
    fn: Callable[..., torch.Tensor]
    dtypes: tuple[torch.dtype, ...] = DTYPES
    others: Callable[[torch.Tensor], Sequence[torch.Tensor]] | None = None
    check: str = "exact"
    width_ratio: int = 1  # the full tensor's columns are multiplied by this
    family: str = ""  # the row it is counted under (default: name)
    dst: torch.dtype | None = None  # the other dtype of a dtype pair (view, cast, copy_)
    domain: Callable[[torch.Tensor], torch.Tensor] | None = None  # maps the input's full value

    @property
    def row(self) -> str:
        return self.family or self.name


def _other_placement(p: Placement) -> Placement:
    """Placement of a second tensor operand: the input's when it is a shard or replica, else Replicate."""
    return p if isinstance(p, (Shard, Replicate)) else Replicate()


def _view_ops() -> list[Op]:
    out = []
    for src in DTYPES:
        for dst in DTYPES:
            ratio = max(1, dst.itemsize // src.itemsize)
            out.append(Op(f"view({_short(dst)})", lambda x, d=dst: x.view(d), (src,),
                          width_ratio=ratio, family="view(dtype)", dst=dst))
    return out


def _cast_ops() -> list[Op]:
    out = []
    for src in DTYPES:
        for dst in DTYPES:
            in_range = functools.partial(_castable, dst=dst)
            out.append(Op(f"to({_short(dst)})", lambda x, d=dst: x.to(d), (src,), family="_to_copy/.to",
                          dst=dst, domain=in_range))
            # copy_ into a tensor of this layout, from a replicated source of another dtype
            out.append(Op(f"copy_ into, from {_short(src)}", lambda x, s: x.copy_(s), (dst,),
                          others=lambda x, s=src: [_castable(_values(x.shape, s, 7), x.dtype)],
                          family="copy_ into", dst=src))
            # copy_ from a source of this layout into a zero destination of another dtype
            out.append(Op(f"copy_ from, into {_short(dst)}", lambda x, d: d.copy_(x), (src,),
                          others=lambda x, d=dst: [torch.zeros(x.shape, dtype=d)], family="copy_ from",
                          dst=dst, domain=in_range))
    return out


def _castable(values: torch.Tensor, dst: torch.dtype) -> torch.Tensor:
    """``values``, made exactly representable in ``dst`` when a float goes to an integer dtype
    (an out-of-range float-to-integer cast is undefined, so the plain op would give no reference).
    The pieces of a ``Partial`` input built from them still take any value."""
    if values.dtype.is_floating_point and not dst.is_floating_point:
        return values.abs().clamp(max=100).round()
    return values


def _foreach(name: str, inplace: bool) -> Op:
    def fn(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        op = getattr(torch, f"_foreach_{name}" + ("_" if inplace else ""))
        scalars = torch.tensor([0.5])
        with implicit_replication():
            out = op([x], [t1], [t2], scalars)
        return x if inplace else out[0]

    return Op(f"_foreach_{name}{'_' if inplace else ''}(scalars tensor)", fn, FLOATS,
              others=lambda x: [_values(x.shape, x.dtype, 11), _values(x.shape, x.dtype, 12).abs() + 1])


def _values(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return random_tensor(tuple(shape), dtype, seed, finite=True)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_SHIFT_DTYPES = INTS

OPS: tuple[Op, ...] = (
    *_view_ops(),
    Op("fill_(Scalar)", lambda x: x.fill_(3)),
    Op("fill_(Tensor)", lambda x, v: x.fill_(v), others=lambda x: [torch.tensor(3, dtype=x.dtype)]),
    *_cast_ops(),
    Op(">> 1", lambda x: x >> 1, _SHIFT_DTYPES),
    Op("<< 1", lambda x: x << 1, _SHIFT_DTYPES),
    Op("+ 3", lambda x: x + 3, FLOATS + INTS),
    Op("- 3", lambda x: x - 3, FLOATS + INTS),
    # float: a Partial input's pieces round on their own, so the result may differ by rounding
    Op("add", lambda x, y: x + y, FLOATS + INTS, others=lambda x: [_values(x.shape, x.dtype, 5)], check="close"),
    Op("sub", lambda x, y: x - y, FLOATS + INTS, others=lambda x: [_values(x.shape, x.dtype, 6)], check="close"),
    Op("mul 3", lambda x: x * 3, FLOATS + INTS),
    Op("sum", lambda x: x.sum(), FLOATS + INTS, check="close"),
    Op("mean", lambda x: x.mean(), FLOATS, check="close"),
    Op("reshape(-1)", lambda x: x.reshape(-1)),
    Op("view(-1)", lambda x: x.view(-1)),
    Op("view(rows, 2, -1)", lambda x: x.view(x.shape[0], 2, -1)),
    Op("view(rows, -1, 2)", lambda x: x.view(x.shape[0], -1, 2)),
    Op("transpose", lambda x: x.transpose(0, 1).contiguous()),
    _foreach("addcdiv", True),
    _foreach("addcmul", True),
    _foreach("addcdiv", False),
    _foreach("addcmul", False),
    # random ops: no reference values, see the module docstring
    Op("rand_like", lambda x: torch.rand_like(x), FLOATS, check="unit"),
    Op("randn_like", lambda x: torch.randn_like(x), FLOATS, check="finite"),
    Op("randint_like", lambda x: torch.randint_like(x, 0, 100), FLOATS + INTS, check="0..100"),
    Op("uniform_", lambda x: x.uniform_(), FLOATS, check="unit"),
    Op("normal_", lambda x: x.normal_(), FLOATS, check="finite"),
    Op("random_(0, 100)", lambda x: x.random_(0, 100), FLOATS + INTS, check="0..100"),
    Op("bernoulli_(0.5)", lambda x: x.bernoulli_(0.5), FLOATS, check="0..2"),
    Op("dropout(0.5)", lambda x: torch.nn.functional.dropout(x, 0.5, True), FLOATS, check="dropout"),
)

RANDOM_CHECKS = ("unit", "finite", "0..100", "0..2", "dropout")


@dataclasses.dataclass(frozen=True)
class KnownWrong:
    """Cases torch gets wrong for a reason written up as an upstream issue (``upstream/issues/``)."""

    row: str
    layouts: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    issue: str  # file name under upstream/issues/
    reason: str


#: Known to be silently wrong, with the upstream issue that says why the series does not fix it.
KNOWN_WRONG: tuple[KnownWrong, ...] = (
    KnownWrong("sum", ("P(sum)",), (torch.uint8, torch.int32), "dtensor-partial-sum-integer-promotion.md",
               "the sum of a narrow-integer Partial(sum) promotes to int64 and keeps Partial(sum)"),
)


def known_wrong(op: Op, dtype: torch.dtype, layout: Layout) -> KnownWrong | None:
    for k in KNOWN_WRONG:
        if k.row == op.row and layout.name in k.layouts and dtype in k.dtypes:
            return k
    return None


# ------------------------------------------------------------------ running
@dataclasses.dataclass
class Case:
    op: Op
    dtype: torch.dtype
    layout: Layout

    @property
    def id(self) -> str:
        return f"{self.op.name} {_short(self.dtype)} {self.layout.name}"

    @property
    def shape(self) -> tuple[int, int]:
        return (ROWS, self.layout.cols * self.op.width_ratio)


@dataclasses.dataclass
class Outcome:
    case: str
    row: str
    outcome: str  # right, raises, wrong, n/a
    detail: str = ""
    comms: int = 0
    placements: str = ""
    digest: str = ""
    known: str = ""  # the upstream issue of a KNOWN_WRONG case


def all_cases(slice_: str = "full") -> list[Case]:
    cases = [Case(op, dt, lay) for op in OPS for dt in op.dtypes for lay in LAYOUTS]
    if slice_ == "fast":
        cases = [c for c in cases if _in_fast_slice(c)]
    return cases


#: The pytest slice (test/dtensor/test_dtensor_audit.py): every op; dtype pairs between one dtype of
#: each width; the other ops on float32, int32 and uint8; every layout but P(avg) and P(min), which
#: take the paths of P(sum) and P(max).
FAST_PAIR_DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.int64)
FAST_DTYPES = (torch.float32, torch.int32, torch.uint8)
FAST_LAYOUTS = ("S(0)", "S(-1) even", "S(-1) uneven", "R", "P(sum)", "P(max)")


def _in_fast_slice(c: Case) -> bool:
    if c.layout.name not in FAST_LAYOUTS:
        return False
    if c.op.dst is not None:
        return c.dtype in FAST_PAIR_DTYPES and c.op.dst in FAST_PAIR_DTYPES
    return c.dtype in FAST_DTYPES


class Auditor:
    """Simulated ranks and a mesh; :meth:`run` judges one case."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=WORLD_SIZE)
        self.mode = LocalTensorMode(WORLD_SIZE)
        with self.mode:
            self.mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        self._representable: dict[tuple, bool] = {}

    def run(self, case: Case) -> Outcome:
        # judged by results: the warnings rules give on the way (redistributions, CPU RNG) are not read
        with self.mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self._run(case)
        k = known_wrong(case.op, case.dtype, case.layout)
        if k is not None and out.outcome == "wrong":
            out.known = k.issue
        return out

    # the full value of the input and of the further operands, as plain tensors
    def _inputs(self, case: Case) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with self.mode.disable():
            x = _values(case.shape, case.dtype, zlib.crc32(case.id.encode()) % 1000)
            if case.op.domain is not None:
                x = case.op.domain(x)
            others = list(case.op.others(x)) if case.op.others else []
        return x, others

    def _dtensor(self, full: torch.Tensor, p: Placement, seed: int) -> DTensor:
        return make_dtensor(full, (p,), self.mesh, seed=seed)

    def _holds(self, full: torch.Tensor, p: Placement) -> bool:
        """Whether ``make_dtensor`` represents ``full`` exactly in this placement."""
        key = (full.dtype, tuple(full.shape), str(p))
        if key not in self._representable:
            try:
                got = self._dtensor(full, p, 0).full_tensor()
                with self.mode.disable():
                    ok = all(bits_equal(v, full) for v in got._local_tensors.values())
            except Exception:
                ok = False
            self._representable[key] = ok
        return self._representable[key]

    def _run(self, case: Case) -> Outcome:
        op, lay = case.op, case.layout
        base = Outcome(case.id, op.row, "n/a")
        x, others = self._inputs(case)
        with self.mode.disable():
            try:
                expected = op.fn(x.clone(), *[o.clone() for o in others])
            except Exception as e:
                base.detail = f"plain op raises {type(e).__name__}"
                return base
        if not self._holds(x, lay.placement):
            base.detail = f"{lay.name} cannot hold {_short(x.dtype)} exactly"
            return base
        other_place = _other_placement(lay.placement)
        if op.check in RANDOM_CHECKS:
            return self._run_random(case, x, expected, base)

        def build() -> list[DTensor]:
            args = [self._dtensor(x, lay.placement, 0)]
            for i, o in enumerate(others):
                args.append(self._dtensor(o, other_place if o.dim() else Replicate(), i + 1))
            return args

        args = build()
        try:
            with CommDebugMode() as comm:
                res = op.fn(*args)
        except Exception as e:
            return dataclasses.replace(base, outcome="raises", detail=f"{type(e).__name__}: {_first_line(e)}")
        base.comms = comm.get_total_counts()
        wrong = self._compare(res, expected, op.check, x)
        if isinstance(res, DTensor):
            base.placements = str(tuple(res.placements))
        base.outcome, base.detail = ("wrong", wrong) if wrong else ("right", "")
        return base

    def _compare(self, res: Any, expected: torch.Tensor, check: str, x: torch.Tensor) -> str:
        """Why ``res`` is not ``expected`` (empty when it is).

        ``"close"``: a float reduction may differ from the plain one by its rounding,
        bounded by 8 epsilons of the dtype times the magnitudes involved (the input's and the
        result's per element; for a reduction to a scalar, the sum of the input's magnitudes)."""
        if not isinstance(res, DTensor):
            return f"returned {type(res).__name__}, not a DTensor"
        if res.shape != expected.shape or res.dtype != expected.dtype:
            return f"global {_short(res.dtype)}{list(res.shape)}, plain {_short(expected.dtype)}{list(expected.shape)}"
        local = res._local_tensor
        for rank in range(WORLD_SIZE):
            if not _plain_placements(res.placements):
                break  # e.g. _StridedShard: its local shapes are checked through full_tensor() only
            want = expected_local_shape(res.shape, res.placements, self.mesh, rank)
            held = local._local_tensors[rank] if isinstance(local, LocalTensor) else local
            if tuple(held.shape) != want:
                return f"rank {rank} holds {tuple(held.shape)}, its spec {tuple(res.placements)} implies {want}"
        try:
            full = res.full_tensor()
        except Exception as e:
            return f"full_tensor() raises {type(e).__name__}: {_first_line(e)}"
        with self.mode.disable():
            for rank, value in sorted(full._local_tensors.items()):
                if check == "close" and expected.dtype.is_floating_point:
                    scale = x.double().abs()
                    scale = scale.sum() if expected.dim() == 0 else scale + expected.double().abs()
                    tol = 8 * torch.finfo(expected.dtype).eps * scale
                    same = bool(((value.double() - expected.double()).abs() <= tol).all())
                else:
                    same = bits_equal(value, expected)
                if not same:
                    return f"rank {rank}: full_tensor() differs from the plain op"
        return ""

    def _run_random(self, case: Case, x: torch.Tensor, expected: torch.Tensor, base: Outcome) -> Outcome:
        seed = zlib.crc32(case.id.encode())
        with self.mode.disable():
            x = x.masked_fill(x == 0, 1)
        results = []
        for _ in range(2):
            arg = self._dtensor(x, case.layout.placement, 0)
            torch.manual_seed(seed)
            try:
                with CommDebugMode() as comm:
                    res = case.op.fn(arg)
            except Exception as e:
                return dataclasses.replace(base, outcome="raises", detail=f"{type(e).__name__}: {_first_line(e)}")
            results.append(res)
        base.comms = comm.get_total_counts()
        res, again = results
        if not isinstance(res, DTensor):
            return dataclasses.replace(base, outcome="wrong", detail=f"returned {type(res).__name__}")
        base.placements = str(tuple(res.placements))
        why = self._random_wrong(case, x, expected, res, again)
        base.outcome, base.detail = ("wrong", why) if why else ("right", "")
        if not why:
            with self.mode.disable():
                full = res.full_tensor()._local_tensors[0]
                base.digest = hashlib.sha1(full.contiguous().view(torch.uint8).numpy().tobytes()
                                           if full.dtype != torch.bool else full.numpy().tobytes()).hexdigest()[:16]
        return base

    def _random_wrong(self, case: Case, x: torch.Tensor, expected: torch.Tensor, res: DTensor,
                      again: DTensor) -> str:
        if res.shape != expected.shape or res.dtype != expected.dtype:
            return f"global {_short(res.dtype)}{list(res.shape)}, plain {_short(expected.dtype)}{list(expected.shape)}"
        if any(isinstance(p, Partial) for p in res.placements):
            return f"random values left pending a reduction: {tuple(res.placements)}"
        local = res._local_tensor._local_tensors
        for rank in range(WORLD_SIZE if _plain_placements(res.placements) else 0):
            want = expected_local_shape(res.shape, res.placements, self.mesh, rank)
            if tuple(local[rank].shape) != want:
                return f"rank {rank} holds {tuple(local[rank].shape)}, its spec implies {want}"
        full = res.full_tensor()._local_tensors
        full_again = again.full_tensor()._local_tensors
        with self.mode.disable():
            value = full[0]
            if any(not bits_equal(full[r], value) for r in range(WORLD_SIZE)):
                return "ranks see different full tensors (replicas disagree)"
            if not bits_equal(full_again[0], value):
                return "the same seed gives other numbers"
            bad = _out_of_range(case.op.check, value, x)
            if bad:
                return bad
            shard = res.placements[0]
            if isinstance(shard, Shard) and value.numel() > 1:
                # dropout: its mask (the input has no zeros)
                shards = [local[r] if case.op.check != "dropout" else local[r] == 0
                          for r in range(WORLD_SIZE) if local[r].numel()]
                for i in range(len(shards)):
                    for j in range(i + 1, len(shards)):
                        if shards[i].shape == shards[j].shape and bits_equal(shards[i], shards[j]):
                            return "two shards drew the same numbers"
            elif value.numel() > 1 and bits_equal(value, value.flatten()[0].expand_as(value)):
                return "every element drew the same number"
        return ""


def _plain_placements(placements: Sequence[Placement]) -> bool:
    """Whether every placement is one ``expected_local_shape`` knows (``Shard``, ``Replicate``, ``Partial``)."""
    return all(type(p) in (Shard, Replicate, Partial) for p in placements)


def _out_of_range(check: str, value: torch.Tensor, x: torch.Tensor) -> str:
    v = value.double()
    if check == "unit":
        ok = bool(((v >= 0) & (v <= 1)).all())
    elif check == "finite":
        ok = bool(torch.isfinite(v).all())
    elif check == "0..100":
        ok = bool(((v >= 0) & (v < 100)).all())
    elif check == "0..2":
        ok = bool(((v == 0) | (v == 1)).all())
    elif check == "dropout":
        kept = (v == 0) | (v == (x.double() * 2).to(value.dtype).double())
        ok = bool(kept.all()) and 0 < int((v == 0).sum()) < v.numel()
    else:
        raise ValueError(check)
    return "" if ok else f"values outside the range of {check!r}"


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:160] if s else ""


# ------------------------------------------------------------------ reporting
def run_audit(cases: Sequence[Case]) -> list[Outcome]:
    auditor = Auditor()
    return [auditor.run(c) for c in cases]


def table(outcomes: Sequence[Outcome]) -> str:
    rows: dict[str, dict[str, int]] = {}
    for o in outcomes:
        r = rows.setdefault(o.row, {"cases": 0, "right": 0, "raises": 0, "wrong": 0, "known": 0,
                                    "n/a": 0, "comm": 0})
        r["cases"] += 1
        r["known" if o.known else o.outcome] += 1
        r["comm"] += bool(o.comms) and o.outcome == "right"
    head = ("op", "cases", "right", "raises", "wrong", "known", "n/a", "comm")
    lines = [head] + [(name, *(str(r[k]) for k in head[1:])) for name, r in rows.items()]
    total = {k: sum(r[k] for r in rows.values()) for k in head[1:]}
    lines.append(("total", *(str(total[k]) for k in head[1:])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def summary(outcomes: Sequence[Outcome]) -> dict[str, int]:
    out = {"cases": len(outcomes), "right": 0, "raises": 0, "wrong": 0, "known": 0, "n/a": 0}
    for o in outcomes:
        out["known" if o.known else o.outcome] += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", action="store_true", help="apply qstate.dtensor_rules.install() first")
    ap.add_argument("--slice", choices=("full", "fast"), default="full")
    ap.add_argument("--json", type=Path, help="write every case's outcome here")
    ap.add_argument("--show", type=int, default=40, help="wrong cases to print (all: -1)")
    ap.add_argument("-k", default="", help="only cases whose id contains this")
    args = ap.parse_args(argv)
    start = time.monotonic()
    import torch.distributed.tensor as dt

    where = os.path.dirname(dt.__file__)
    overlay = os.environ.get("DTENSOR_OVERLAY")
    if overlay and not where.startswith(overlay):
        raise RuntimeError(f"DTENSOR_OVERLAY={overlay} but torch.distributed.tensor is {where}")
    if args.install:
        if importlib.util.find_spec("qstate") is None:  # not on PYTHONPATH: this checkout's
            sys.path.insert(0, str(HERE.parent))
        import qstate.dtensor_rules as rules

        rules.install()
    rules_state = "install()" if args.install else "torch's own rules"
    if args.install:
        rules_state += f" of {os.path.dirname(os.path.dirname(rules.__file__))}"
    print(f"torch {torch.__version__}, torch.distributed.tensor from {where}; {rules_state}")
    cases = [c for c in all_cases(args.slice) if args.k in c.id]
    outcomes = run_audit(cases)
    print(table(outcomes))
    wrong = [o for o in outcomes if o.outcome == "wrong"]
    silent = [o for o in wrong if not o.known]
    shown = silent if args.show < 0 else silent[: args.show]
    if silent:
        print(f"silently wrong ({len(silent)}):")
        for o in shown:
            print(f"  {o.case} -> {o.placements}: {o.detail}")
        if len(shown) < len(silent):
            print(f"  ... {len(silent) - len(shown)} more (--show -1)")
    for o in wrong:
        if o.known:
            print(f"  known ({o.known}): {o.case}: {o.detail}")
    s = summary(outcomes)
    print(f"audit: {s['cases']} cases: {s['right']} right, {s['raises']} raise, {s['wrong']} silently wrong, "
          f"{s['known']} known wrong, {s['n/a']} n/a; {time.monotonic() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=0))
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())

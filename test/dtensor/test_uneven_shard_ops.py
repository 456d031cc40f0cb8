"""Every family of ops on a DTensor over a quantized state with uneven shards (129 rows on 2 gloo ranks,
193 on 3), against the same op on a plain DTensor of the state's values: each op gives those values (a
read), the requantized values (an in-place op, through the state or a view of it), or raises on every
rank where DTensor raises for the plain values too; none leaves a rank waiting in a collective (the
process group's timeout turns a wait into a failure that names the op)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed

COLS = 300

#: name -> op on a DTensor ``t`` (``x``: a plain DTensor like it, ``w``: a replicated [COLS, 4] matrix)
READS = {
    "mul": lambda t, x, w: t * 2,
    "add": lambda t, x, w: t + x,
    "sqrt": lambda t, x, w: t.abs().sqrt(),
    "neg": lambda t, x, w: -t,
    "gt": lambda t, x, w: t > 0,
    "clamp_min": lambda t, x, w: t.clamp_min(0),
    "where": lambda t, x, w: torch.where(t > 0, t, x),
    "sum": lambda t, x, w: t.sum(),
    "mean": lambda t, x, w: t.mean(),
    "amax": lambda t, x, w: t.amax(),
    "norm": lambda t, x, w: torch.linalg.vector_norm(t),
    "sum(dim=0)": lambda t, x, w: t.sum(dim=0),
    "mean(dim=0)": lambda t, x, w: t.mean(dim=0),
    "sum(dim=1)": lambda t, x, w: t.sum(dim=1),
    "mm": lambda t, x, w: t @ w,
    "mv": lambda t, x, w: t @ w[:, 0].contiguous(),
    "exp": lambda t, x, w: t.exp(),
    "var(dim=1)": lambda t, x, w: t.var(dim=1),
    "max(dim=1)": lambda t, x, w: t.amax(dim=1),
    "logsumexp(dim=0)": lambda t, x, w: t.logsumexp(dim=0),
    "t": lambda t, x, w: t.t(),
    "transpose": lambda t, x, w: t.transpose(0, 1),
    "select(0)": lambda t, x, w: t.select(0, 128),
    "select(1)": lambda t, x, w: t.select(1, 7),
    "slice(0)": lambda t, x, w: t[3:70],
    "slice(1)": lambda t, x, w: t[:, 1:5],
    "reshape": lambda t, x, w: t.reshape(-1),
    "view": lambda t, x, w: t.view(t.shape[0], 2, COLS // 2),
    "pad": lambda t, x, w: F.pad(t, (0, 0, 0, 1)),
    "pad(1)": lambda t, x, w: F.pad(t, (0, 3)),
    "float": lambda t, x, w: t.float(),
    "to(bfloat16)": lambda t, x, w: t.to(torch.bfloat16),
    "clone": lambda t, x, w: t.clone(),
    "redistribute": lambda t, x, w: t.redistribute(t.device_mesh, [torch.distributed.tensor.Replicate()]),
}
#: name -> in-place op on ``t`` (its result: ``t``'s new values)
WRITES = {
    "mul_": lambda t, x: t.mul_(0.5),
    "add_": lambda t, x: t.add_(x),
    "lerp_": lambda t, x: t.lerp_(x, 0.1),
    "copy_": lambda t, x: t.copy_(x),
    "addcmul_": lambda t, x: t.addcmul_(x, x, value=0.25),
    "clamp_min_": lambda t, x: t.clamp_min_(0),
    "neg_": lambda t, x: t.neg_(),
    "tanh_": lambda t, x: t.tanh_(),
    "zero_": lambda t, x: t.zero_(),
    "t().mul_": lambda t, x: t.t().mul_(0.5),
    "slice(1).add_": lambda t, x: t[:, 1:5].add_(x[:, 1:5]),
    "select(1).copy_": lambda t, x: t.select(1, 7).copy_(x.select(1, 7)),
    "transpose.lerp_": lambda t, x: t.transpose(0, 1).lerp_(x.transpose(0, 1), 0.1),
}


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the outcome asserted below
        return "raise", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _values(t: torch.Tensor) -> torch.Tensor:
    """A DTensor result's full values as a plain tensor (a state's or a view's dequantized)."""
    import qstate

    full = t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t
    return qstate.dequantize(full)


def sweep_body(rank: int, world_size: int, fmt: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import qstate

    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(0)
    rows = 64 * world_size + 1  # uneven shards: the last rank's is one row short
    full = qstate.quantize(torch.randn(rows, COLS, generator=gen), fmt).dequantize()
    other = torch.randn(rows, COLS, generator=gen)
    w = distribute_tensor(torch.randn(COLS, 4, generator=gen), mesh, [Replicate()])
    report = []

    def fresh():
        state = qstate.quantize(distribute_tensor(full, mesh, [Shard(0)]), fmt)
        return state, distribute_tensor(full.clone(), mesh, [Shard(0)]), distribute_tensor(other, mesh, [Shard(0)])

    ops = [(name, lambda t, x, op=op: op(t, x, w), False) for name, op in READS.items()]
    ops += [(name, op, True) for name, op in WRITES.items()]
    for name, op, in_place in ops:
        state, plain, x = fresh()
        # the result's full values: gathering them is part of the op's outcome
        got = _outcome(lambda: _values(state) if op(state, x) is not None and in_place else _values(op(state, x)))
        kinds = [None] * world_size
        dist.all_gather_object(kinds, got[0])  # every rank got past the op (or the timeout fired)
        assert len(set(kinds)) == 1, f"{name}: outcomes differ across ranks: {kinds} ({got[1]})"
        want = _outcome(lambda: _values(plain) if op(plain, x) is not None and in_place else _values(op(plain, x)))
        if got[0] == "raise":  # only where DTensor raises for plain values too
            assert want[0] == "raise", f"{name}: the plain DTensor's op runs, the state's raises: {got[1]}"
            report.append((name, got[1]))
            continue
        assert want[0] == "ok", f"{name}: the state's op runs, the plain DTensor's raises: {want[1]}"
        if in_place:
            assert torch.equal(got[1], qstate.quantize(want[1], fmt).dequantize()), name
        else:
            assert type(got[1]) is torch.Tensor, f"{name}: a read returned {type(got[1]).__name__}"
            torch.testing.assert_close(got[1], want[1], msg=name)
    if rank == 0:
        print("raised on every rank:", *[f"{n}: {e}" for n, e in report], sep="\n  ")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_every_op_family_on_uneven_shards_answers_on_every_rank(world_size: int, fmt: str) -> None:
    run_distributed(sweep_body, world_size, fmt, timeout=60)

"""The bf16 stochastic-rounding stream is the same on every rank: with ``seed=None`` rank 0's drawn seed is
broadcast at the first rounding step (ranks seeded differently, as trainers seed them, still agree)."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from dist_utils import run_distributed
from qstate.optim import SGD, AdamW

STEPS = 5


def _start() -> torch.Tensor:
    """The same bf16 weights on every rank (a generator of their own, not the rank's global one)."""
    return torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).bfloat16()


def _grad(step: int) -> torch.Tensor:
    return torch.randn(64, 128, generator=torch.Generator().manual_seed(100 + step)).bfloat16()


def _optimizer(p: torch.nn.Parameter, seed=None) -> AdamW:
    # lr 1e-3: each update is below bf16's spacing, so the rounding draws decide the parameter
    return AdamW([p], lr=1e-3, state_format="8bit", bf16_stochastic_round=True, compile=False, seed=seed)


def _steps(p: torch.nn.Parameter, opt: AdamW, first: int, last: int) -> None:
    for step in range(first, last):
        p.grad = _grad(step)
        opt.step()


def _through_a_file(state_dict: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _same_on_every_rank(t: torch.Tensor) -> bool:
    # compare bits: bf16 parameters as their int16 bits (widened: gloo gathers no int16)
    bits = t.detach().view(torch.int16).int() if t.dtype == torch.bfloat16 else t
    return all(torch.equal(bits, other) for other in _gathered(bits))


def _seeds(opt) -> torch.Tensor:
    return torch.tensor([g["seed"] for g in opt.param_groups], dtype=torch.int64)


def _replicas(rank: int, world_size: int) -> None:
    # seed=None: each rank draws its own seed at construction (no collective); the first step agrees on rank 0's
    # with one broadcast of one int64, on the CPU (gloo broadcasts there)
    torch.manual_seed(rank)
    p = torch.nn.Parameter(_start())
    opt = _optimizer(p)
    assert not _same_on_every_rank(_seeds(opt))
    broadcast, broadcasts = dist.broadcast, []

    def recorded(tensor, *args, **kwargs):
        broadcasts.append((tensor.dtype, tuple(tensor.shape), tensor.device))
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = recorded
    try:
        _steps(p, opt, 0, STEPS)
    finally:
        dist.broadcast = broadcast
    assert broadcasts == [(torch.int64, (1,), torch.device("cpu"))]
    assert _same_on_every_rank(_seeds(opt))
    assert _same_on_every_rank(p)
    assert not torch.equal(p.detach(), _start())

    # DTensor replicas (Replicate on a 1-D mesh) round alike too
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(30 + rank)
    d = torch.nn.Parameter(distribute_tensor(_start(), mesh, [Replicate()]))
    replicated = _optimizer(d)
    for step in range(STEPS):
        d.grad = distribute_tensor(_grad(step), mesh, [Replicate()])
        replicated.step()
    assert _same_on_every_rank(d.to_local())
    plain = torch.nn.Parameter(_start())  # and as one plain parameter with the agreed seed
    _steps(plain, _optimizer(plain, seed=replicated.param_groups[0]["seed"]), 0, STEPS)
    assert torch.equal(d.to_local().view(torch.int16), plain.detach().view(torch.int16))

    # the check above would see diverged replicas: seeds that differ by rank give different parameters
    q = torch.nn.Parameter(_start())
    _steps(q, _optimizer(q, seed=1000 + rank), 0, STEPS)
    assert not _same_on_every_rank(q)

    # an explicit seed is used as is (no broadcast replaces it): the same seed, the same parameters
    q = torch.nn.Parameter(_start())
    explicit = _optimizer(q, seed=0)
    _steps(q, explicit, 0, STEPS)
    assert explicit.param_groups[0]["seed"] == 0 and _same_on_every_rank(q)

    # a resumed run (state_dict -> new optimizer -> load) continues the agreed stream
    torch.manual_seed(10 + rank)
    r = torch.nn.Parameter(_start())
    first = _optimizer(r)
    _steps(r, first, 0, 3)
    saved = _through_a_file(first.state_dict())
    torch.manual_seed(20 + rank)
    resumed = _optimizer(r)
    resumed.load_state_dict(saved)
    _steps(r, resumed, 3, STEPS)
    assert resumed.param_groups[0]["seed"] == saved["param_groups"][0]["seed"]
    assert _same_on_every_rank(r)
    uninterrupted = torch.nn.Parameter(_start())
    one_run = _optimizer(uninterrupted, seed=saved["param_groups"][0]["seed"])
    _steps(uninterrupted, one_run, 0, STEPS)
    assert torch.equal(r.detach().view(torch.int16), uninterrupted.detach().view(torch.int16))


def test_replicas_seeded_differently_round_alike():
    run_distributed(_replicas, 2)


def _seed_drawn_at_construction() -> None:
    assert not dist.is_initialized()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    p = torch.nn.Parameter(_start())
    opt = _optimizer(p)
    drawn = opt.param_groups[0]["seed"]
    # from a private generator seeded with torch.initial_seed(): no draw from torch's generator, and the same
    # torch.manual_seed gives the same seed (another gives another)
    assert torch.equal(torch.get_rng_state(), before)
    assert _optimizer(torch.nn.Parameter(_start())).param_groups[0]["seed"] == drawn
    torch.manual_seed(4)
    assert _optimizer(torch.nn.Parameter(_start())).param_groups[0]["seed"] != drawn
    _steps(p, opt, 0, STEPS)
    assert opt.param_groups[0]["seed"] == drawn and opt.defaults["seed"] == drawn
    q = torch.nn.Parameter(_start())
    _steps(q, _optimizer(q, seed=drawn), 0, STEPS)
    assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))


def test_without_torch_distributed_the_seed_is_drawn_at_construction():
    # in a fresh process: tests run earlier in this one may have initialized a (fake) process group
    proc = torch.multiprocessing.get_context("spawn").Process(target=_seed_drawn_at_construction)
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, f"the check failed in its process (exit code {proc.exitcode}; its traceback above)"

def test_a_group_with_its_own_seed_keeps_it():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(_start()), torch.nn.Parameter(_start())
    opt = SGD([{"params": [a]}, {"params": [b], "seed": 5}], lr=1e-3, bf16_stochastic_round=True)
    a.grad, b.grad = _grad(0), _grad(0)
    opt.step()
    assert opt.param_groups[1]["seed"] == 5 and opt.param_groups[0]["seed"] == opt.defaults["seed"]


"""FSDP2 with 8-bit AdamW states: train on 2 local ranks, checkpoint, resume on 3.

The smallest end-to-end use of qstate with FSDP2 and
``torch.distributed.checkpoint`` (``python -m qstate.demo`` is the full tour):

    python examples/fsdp2_adamw_8bit.py

Runs on the CPU with gloo. The first dims 257 and 65 are not divisible by 2
or 3, so the FSDP2 shards are uneven; the optimizer states are DTensors over
each rank's :class:`qstate.QuantizedState` rows.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import qstate
import qstate.checkpoint
import qstate.optim
from qstate.launch import run_ranks


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded MLP initialized from ``seed`` and its 8-bit AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(129, 257), nn.GELU(), nn.Linear(257, 65))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, qstate.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, state_format="8bit")


def show_state(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """Rank 0 prints what every rank holds for the first layer's ``exp_avg``."""
    state = opt.state[model[0].weight]["exp_avg"]
    local = state.to_local()
    line = (f"  rank {dist.get_rank()}: exp_avg {tuple(state.shape)} {state.placements} -> local {local!r}, "
            f"{local.storage_nbytes()} bytes")
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def train(rank: int, world_size: int, path: str) -> None:
    model, opt = build(seed=0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        x = torch.randn(32, 129, generator=g)
        loss = (model(x) - x[:, :65]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    show_state(opt, model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def resume(rank: int, world_size: int, path: str) -> None:
    model, opt = build(seed=1)
    model_sd, optim_sd = get_state_dict(model, opt)  # creates zero states to load into
    sd = {"model": model_sd, "optim": optim_sd}
    qstate.checkpoint.load(sd, checkpoint_id=path)  # all or nothing: errors name the state
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    show_state(opt, model)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as checkpoint:
        print("training on 2 ranks, then saving a DCP checkpoint:")
        run_ranks(train, 2, checkpoint)
        print("resuming from it on 3 ranks:")
        run_ranks(resume, 3, checkpoint)

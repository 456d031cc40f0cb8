"""Run a test body in real gloo processes (world size 2 or 3) on the CPU."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errfile: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes.

    ``fn`` must be importable (module level). A failure on any rank raises
    here with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        errfile = os.path.join(tmp, "err")
        try:
            mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, errfile),
                               nprocs=world_size, start_method="spawn", join=True)
        except mp.ProcessRaisedException as e:
            msgs = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.startswith("err")]
            raise AssertionError("\n".join(msgs) or str(e)) from None

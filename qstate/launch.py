"""Start local ranks in-process: ``run_ranks(fn, world_size, *args)``.

Used by the demo, the benchmarks and the tests. Each rank is a spawned
process with ``MASTER_ADDR=127.0.0.1``, a free port, one intra-op thread,
and a process group on ``backend`` (gloo on CPU by default). A failure on
any rank raises here with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "default_backend"]


def default_backend() -> str:
    """``nccl`` when every rank can have its own GPU, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, backend: str, fn: Callable,
               args: tuple, errfile: str, timeout: Optional[float] = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Success: leave without interpreter finalization, where gloo's worker threads can still
    # release tensors and abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: Optional[float] = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks and wait.

    ``fn`` must be importable (defined at module level). ``timeout``: the process group's, in seconds
    (a collective waiting longer raises on its rank; None: torch's default).
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory() as tmp:
        errfile = os.path.join(tmp, "err")
        try:
            mp.start_processes(_rank_main, args=(world_size, _free_port(), backend, fn, args, errfile, timeout),
                               nprocs=world_size, start_method="spawn", join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            msgs = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.startswith("err")]
            raise RuntimeError("\n".join(msgs) or str(e)) from None

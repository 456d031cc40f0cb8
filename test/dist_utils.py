"""Run a test body in real gloo processes (world size 1, 2 or 3) on the CPU."""

from __future__ import annotations

from typing import Any, Callable

from qstate.launch import run_ranks


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; raise on any failure
    (``timeout``: the process group's, in seconds: a collective left waiting raises)."""
    run_ranks(fn, world_size, *args, backend="gloo", timeout=timeout)

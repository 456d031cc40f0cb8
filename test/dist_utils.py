"""Run a test body in real gloo processes (world size 1, 2 or 3) on the CPU."""

from __future__ import annotations

from typing import Any, Callable

from qstate.launch import run_ranks


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; raise on any failure."""
    run_ranks(fn, world_size, *args, backend="gloo")

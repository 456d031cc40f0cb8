"""Shared test configuration: hypothesis profiles, the test folder on sys.path, process groups per module."""

import os
import sys

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)
# new examples on every run (CI's are fixed): HYPOTHESIS_PROFILE=soak pytest ... to look for failures CI's miss
settings.register_profile("soak", settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module", autouse=True)
def _process_group_ends_with_its_module():
    """A module that starts a process group (the fake one of simulated ranks) ends it with the module, so
    that the next module's one-process code (``torch.distributed.checkpoint`` without a group) sees none."""
    started_here = not dist.is_initialized()
    yield
    if started_here and dist.is_initialized():
        dist.destroy_process_group()

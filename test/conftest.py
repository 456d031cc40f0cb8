"""Shared test configuration: hypothesis profiles and the test folder on sys.path."""

import os
import sys

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

"""The integration tests run with the real trainers and optimizer libraries of ``pip install -e ".[integrations]"``.

Without them each test skips, naming the package. ``.ci/run`` installs the extra and sets
``QSTATE_REQUIRE_INTEGRATIONS=1``, under which a missing package is an error, never a skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(package: str) -> ModuleType:
    """``package``, imported; a skip naming it where it is absent (an error under
    ``QSTATE_REQUIRE_INTEGRATIONS=1``)."""
    if os.environ.get("QSTATE_REQUIRE_INTEGRATIONS") == "1":
        return importlib.import_module(package)
    return pytest.importorskip(package, reason=f'{package} is not installed: pip install -e ".[integrations]"')

"""Turning "this op would communicate" into a clear error, on request.

Some rules reduce a ``Partial`` input first rather than return a wrong local
result (``copy_``/``_to_copy`` through a cast that does not commute).  Code
that must not communicate (an optimizer step that is supposed to be purely
local) wraps itself in :func:`forbid_implicit_communication`; any implicit
redistribution that moves data then raises :class:`ImplicitCommunicationError`
naming the op and the rule that asked for it.

This reuses DTensor's own ``ExplicitRedistributionContext`` (checked at
redistribution time, never cached), so no sharding decision depends on it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from qstate.dtensor_rules._catalog import RULES

__all__ = ["ImplicitCommunicationError", "forbid_implicit_communication"]


class ImplicitCommunicationError(RuntimeError):
    """An op needed a communicating redistribution inside a no-communication region."""


def _rule_reason(message: str) -> str:
    for rule in RULES:
        if re.search(rf"\b{re.escape(str(rule.op))}(\(|\s|$)", message):
            return f"\nqstate rule for {rule.op}: {rule.reason}"
    return ""


@contextlib.contextmanager
def forbid_implicit_communication() -> Iterator[None]:
    """Fail instead of implicitly redistributing with communication.

    Inside the region DTensor raises its ``RuntimeError`` at the offending op;
    when it leaves the region it is re-raised as :class:`ImplicitCommunicationError`
    (a ``RuntimeError``) naming the qstate rule that asked for the redistribution.
    Redistributions that move no data (e.g. ``Replicate -> Shard``) stay allowed.
    """
    from torch.distributed.tensor._utils import ExplicitRedistributionContext

    try:
        with ExplicitRedistributionContext(enable=True, strict=False, mode="raise"):
            yield
    except RuntimeError as e:
        msg = str(e)
        if "ExplicitRedistributionContext" not in msg or isinstance(
            e, ImplicitCommunicationError
        ):
            raise
        raise ImplicitCommunicationError(
            f"{msg}\nThis op needs communication to be correct; redistribute "
            "explicitly (e.g. .redistribute(mesh, [Replicate()])) before it, or run "
            f"it outside forbid_implicit_communication().{_rule_reason(msg)}"
        ) from e

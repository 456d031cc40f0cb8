"""DTensor sharding rules: qstate's own operators, and the upstream series applied at run time.

Two sets of rules, as data:

* :data:`QSTATE_OP_RULES`, the rules of qstate's own operators (``fused_update`` shard by shard,
  ``flat_index_like``, ``stochastic_round_bf16``, ``copy_with_draws_``), registered by
  ``import qstate`` (:func:`register_qstate_ops`). Every entry is keyed by a ``qstate::`` op, so
  none changes the result of a torch op.
* :data:`RULES`, the upstream patch series (``upstream/``, ``docs/upstream.md``: exact
  ``view(dtype)``, casts and ``fill_``/``copy_`` on ``Partial``, per-shard random ops on CPU
  meshes, foreach scalars, shifts, integer ``add``/``sub``), one module per patch, with the
  patched torch's op coverage and semantics. Opt-in: :func:`install`.

Importing this package changes nothing. :func:`install` writes :data:`RULES` into DTensor's
tables, :func:`uninstall` puts torch's entries back, :func:`installed` lists what is overridden
and why. Each rule first asks torch (a feature check of torch's own decision for the case its
patch fixes): on a torch that has the patch, :func:`install` leaves torch's rule and
:func:`not_needed` lists it; a check that cannot run raises and nothing is installed. From a
``sitecustomize``: ``import qstate.dtensor_rules as r; r.install()``.
"""

from __future__ import annotations

from qstate.dtensor_rules import _cpu_random
from qstate.dtensor_rules._catalog import QSTATE_OP_RULES, RULES
from qstate.dtensor_rules._fused_ops import flat_starts, LayoutMismatch
from qstate.dtensor_rules._positional import positional_randint_like
from qstate.dtensor_rules._registry import InstalledOverride, Registry, Rule

__all__ = [
    "InstalledOverride",
    "LayoutMismatch",
    "QSTATE_OP_RULES",
    "RULES",
    "Rule",
    "flat_starts",
    "install",
    "installed",
    "is_installed",
    "not_needed",
    "positional_randint_like",
    "register_qstate_ops",
    "uninstall",
]

_QSTATE_OPS = Registry(QSTATE_OP_RULES)
_REGISTRY = Registry(RULES)


def register_qstate_ops() -> None:
    """Write :data:`QSTATE_OP_RULES` into DTensor's tables (idempotent; ``import qstate`` calls it).
    :func:`uninstall` leaves them in place."""
    _QSTATE_OPS.install()


def install() -> None:
    """Apply the upstream patch series at run time: write the :data:`RULES` this torch needs into
    DTensor's tables and clear its caches (idempotent).

    Opt-in: it changes what torch's own ops return on any DTensor, qstate's or not; ``import qstate``
    does not call it, and qstate's states and optimizers do not need it. Install before starting
    threads that run DTensor ops (torch caches sharding decisions per thread)."""
    _REGISTRY.install()


def uninstall() -> None:
    """Restore torch's entries that :func:`install` replaced and clear the caches (idempotent); DTensor's
    RNG tracker goes back to none if it is the CPU one the installed random rules created."""
    _REGISTRY.uninstall()
    _cpu_random.drop_tracker()


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _REGISTRY.is_installed()


def installed() -> list[InstalledOverride]:
    """The table entries :func:`install` currently overrides, with the reason for each."""
    return _REGISTRY.installed()


def not_needed() -> list[Rule]:
    """The rules :func:`install` left out because this torch's own rule already has the fix."""
    return _REGISTRY.not_needed()

"""DTensor sharding rules: qstate's own operators, and opt-in fixes of torch's.

``qstate`` keeps optimizer state in tensor subclasses whose bits are
manipulated with ``view(dtype)``, integer masks and stochastic rounding, and
expects DTensor / FSDP2 to run those ops shard by shard.  This package holds
two sets of rules, as data, installed at different times:

* :data:`QSTATE_OP_RULES`, the rules of qstate's own operators, registered by
  ``import qstate`` (:func:`register_qstate_ops`).  Every entry is keyed by a
  ``qstate::`` op, so none can change the result of a torch op:

  * :mod:`._fused_ops`    ``qstate::fused_update`` (the optimizers' update):
    shard by shard when param, grad and states share one layout; its
    ``starts`` (:func:`flat_starts`) give each shard its place in the full
    parameter
  * :mod:`._random_ops`   ``qstate::flat_index_like``: each shard's global
    element indices, which stochastic rounding hashes
  * :mod:`._rounding_ops` ``qstate::stochastic_round_bf16``: shard by shard,
    ``Partial`` reduced first; ``qstate::copy_with_draws_``: in place, shard by
    shard, ``src`` and ``draws`` brought to ``self``'s layout

  qstate's states and optimizers need nothing else: on DTensors they call
  these ops and otherwise only aten ops whose torch rules are right for the
  layouts they use (``torch.bitwise_right_shift``, not ``>>``).

* :data:`RULES`, replacements of torch's rules for aten ops: the upstream
  patch series (``upstream/``, ``docs/upstream.md``), applied at run time,
  with the fixes not yet written as patches.  Opt-in (:func:`install`): they
  change what torch's ops return on every DTensor, not only qstate's.

  * :mod:`._view_ops`    ``aten.view.dtype``
  * :mod:`._random_ops`  ``randint_like`` / ``rand_like`` / ``random_``: values
    are a hash of (seed, global element index), so shards are independent,
    reproducible and layout-invariant
  * :mod:`._partial_ops` ``fill_``, ``copy_`` and integer ``add``/``sub`` on
    ``Partial`` inputs
  * :mod:`._shift_ops`   ``>>`` / ``<<`` (``aten.__rshift__`` / ``__lshift__``),
    which torch returns unchanged

Importing this package changes nothing.  :func:`install` writes :data:`RULES`
into DTensor's tables, :func:`uninstall` puts torch's entries back,
:func:`installed` lists what is overridden and why.  Each rule carries a
feature check (:mod:`._probe`: torch's own sharding decision for the case the
rule fixes, on a CPU mesh that needs no process group): on a torch that
already has a fix, :func:`install` leaves torch's rule for it in place and
:func:`not_needed` lists it.
"""

from __future__ import annotations

from qstate.dtensor_rules._catalog import QSTATE_OP_RULES, RULES
from qstate.dtensor_rules._fused_ops import LayoutMismatch, flat_starts
from qstate.dtensor_rules._comm import (
    forbid_implicit_communication,
    ImplicitCommunicationError,
)
from qstate.dtensor_rules._random_ops import (
    positional_rand_like,
    positional_randint_like,
    positional_random_,
)
from qstate.dtensor_rules._registry import InstalledOverride, Registry, Rule
from qstate.dtensor_rules._view_ops import UnrepresentableShardWarning


__all__ = [
    "ImplicitCommunicationError",
    "InstalledOverride",
    "LayoutMismatch",
    "RULES",
    "Rule",
    "UnrepresentableShardWarning",
    "flat_starts",
    "forbid_implicit_communication",
    "QSTATE_OP_RULES",
    "install",
    "installed",
    "is_installed",
    "not_needed",
    "positional_rand_like",
    "positional_randint_like",
    "positional_random_",
    "register_qstate_ops",
    "uninstall",
]

_QSTATE_OPS = Registry(QSTATE_OP_RULES)
_REGISTRY = Registry(RULES)


def register_qstate_ops() -> None:
    """Write :data:`QSTATE_OP_RULES` into DTensor's tables (idempotent; ``import qstate`` calls it).

    Every entry is keyed by a ``qstate::`` op, so no torch op changes; :func:`uninstall` leaves
    them in place."""
    _QSTATE_OPS.install()


def install() -> None:
    """Apply the upstream patch series (``upstream/``) at run time: write the :data:`RULES` this
    torch needs into DTensor's tables and clear its caches (idempotent).

    A rule whose fix this torch already has (its ``needed`` check reads torch's own rule) is not
    written; :func:`not_needed` lists those.

    Opt-in: this changes what torch's own ops return on any DTensor, qstate's or not
    (``view(dtype)``, random ops, ``fill_``/``copy_``/integer ``add``/``sub`` on ``Partial``,
    ``>>``/``<<``); ``import qstate`` does not call it, and qstate's states and optimizers do not
    need it.  Install before starting threads that run DTensor ops (torch
    2.13 caches sharding decisions per thread)."""
    _REGISTRY.install()


def uninstall() -> None:
    """Restore torch's entries that :func:`install` replaced and clear the caches (idempotent).

    The rules of qstate's own operators (:func:`register_qstate_ops`) stay."""
    _REGISTRY.uninstall()


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _REGISTRY.is_installed()


def installed() -> list[InstalledOverride]:
    """The table entries :func:`install` currently overrides, with the reason for each."""
    return _REGISTRY.installed()


def not_needed() -> list[Rule]:
    """The rules :func:`install` left out because this torch's own rule already has the fix."""
    return _REGISTRY.not_needed()

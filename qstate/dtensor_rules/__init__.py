"""DTensor sharding rules for the ops quantized optimizer states rely on.

``qstate`` keeps optimizer state in tensor subclasses whose bits are
manipulated with ``view(dtype)``, integer masks and stochastic rounding, and
expects DTensor / FSDP2 to run those ops shard by shard.  torch's own rules get
some of them wrong (see ``docs/upstream.md``); this package holds the
replacements as data:

* :mod:`._view_ops`    ``aten.view.dtype``
* :mod:`._random_ops`  ``randint_like`` / ``rand_like`` / ``random_``: values are
  a hash of (seed, global element index), so shards are independent,
  reproducible and layout-invariant; and ``qstate::flat_index_like`` (each
  shard's global element indices, which stochastic rounding hashes)
* :mod:`._partial_ops` ``fill_``, ``copy_`` and integer ``add``/``sub`` on
  ``Partial`` inputs
* :mod:`._shift_ops`   ``>>`` / ``<<`` (``aten.__rshift__`` / ``__lshift__``),
  which torch returns unchanged
* :mod:`._rounding_ops` ``qstate::stochastic_round_bf16``: shard by shard,
  ``Partial`` reduced first
* :mod:`._fused_ops`   ``qstate::fused_update`` (qstate's optimizer update): shard
  by shard when param, grad and states share one layout

Importing this package changes nothing; :func:`install` (called by
``import qstate``) writes the rules into DTensor's tables, :func:`uninstall`
puts torch's entries back, :func:`installed` lists what is overridden and why.
"""

from __future__ import annotations

from qstate.dtensor_rules import _fused_ops, _partial_ops, _random_ops, _rounding_ops, _shift_ops, _view_ops
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
    "RULES",
    "Rule",
    "UnrepresentableShardWarning",
    "forbid_implicit_communication",
    "install",
    "installed",
    "is_installed",
    "positional_rand_like",
    "positional_randint_like",
    "positional_random_",
    "uninstall",
]

#: Every rule this package knows, in the order it is applied.
RULES: tuple[Rule, ...] = (_view_ops.RULES + _random_ops.RULES + _partial_ops.RULES + _shift_ops.RULES
                          + _rounding_ops.QSTATE_OP_RULES + _fused_ops.RULES)

_REGISTRY = Registry(RULES)


def install() -> None:
    """Write :data:`RULES` into DTensor's tables and clear its caches (idempotent)."""
    _REGISTRY.install()


def uninstall() -> None:
    """Restore torch's original table entries and clear the caches (idempotent)."""
    _REGISTRY.uninstall()


def is_installed() -> bool:
    return _REGISTRY.is_installed()


def installed() -> list[InstalledOverride]:
    """The table entries currently overridden, with the reason for each."""
    return _REGISTRY.installed()

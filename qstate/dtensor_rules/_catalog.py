"""The package's two rule sets as data (see :mod:`qstate.dtensor_rules`): the rules of qstate's own
operators and the replacements of torch's rules for aten ops."""

from __future__ import annotations

from qstate.dtensor_rules import _fused_ops, _partial_ops, _random_ops, _rounding_ops, _shift_ops, _view_ops
from qstate.dtensor_rules._registry import Rule

__all__ = ["QSTATE_OP_RULES", "RULES"]

#: The rules of qstate's own operators, registered by ``import qstate``.
QSTATE_OP_RULES: tuple[Rule, ...] = (_random_ops.QSTATE_OP_RULES + _rounding_ops.QSTATE_OP_RULES
                                     + _fused_ops.QSTATE_OP_RULES)

#: Replacements of torch's rules for aten ops (the upstream patch series), in the order
#: :func:`qstate.dtensor_rules.install` applies them.
RULES: tuple[Rule, ...] = _view_ops.RULES + _random_ops.RULES + _partial_ops.RULES + _shift_ops.RULES

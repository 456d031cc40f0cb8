"""The package's two rule sets as data (see :mod:`qstate.dtensor_rules`): the rules of qstate's own
operators and the replacements of torch's rules for aten ops (the upstream series)."""

from __future__ import annotations

from qstate.dtensor_rules import (_cpu_random, _fill_and_copy, _foreach_scalars, _fused_ops, _integer_add,
                                  _positional, _rounding_ops, _shift_ops, _view_dtype)
from qstate.dtensor_rules._registry import Rule

__all__ = ["QSTATE_OP_RULES", "RULES"]

#: The rules of qstate's own operators, registered by ``import qstate``.
QSTATE_OP_RULES: tuple[Rule, ...] = (_positional.QSTATE_OP_RULES + _rounding_ops.QSTATE_OP_RULES
                                     + _fused_ops.QSTATE_OP_RULES)

#: Replacements of torch's rules for aten ops, in the series' order (patches 0001-0008), which
#: :func:`qstate.dtensor_rules.install` applies.
RULES: tuple[Rule, ...] = (_view_dtype.RULES + _fill_and_copy.RULES + _cpu_random.RULES + _foreach_scalars.RULES
                           + _shift_ops.RULES + _integer_add.RULES)

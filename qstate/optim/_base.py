"""``QuantizedOptimizer``: the base of the elementwise optimizers, one ``step`` for every rule.

A subclass names its :class:`~qstate.optim.rules.UpdateRule` (:attr:`QuantizedOptimizer.rule`), its
hyperparameters (``defaults``) and their checks, and the rule's static flags
(:meth:`QuantizedOptimizer.rule_flags`); the states, the policy, the step's skeleton and the
state dict are :class:`~._policy_optimizer.PolicyOptimizer`'s. A group's update is
:func:`qstate.optim._step.prepare_update` of the rule, on the path the group's ``fused``/``foreach``
choose (:func:`~._arguments.update_path`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from . import _step
from ._arguments import FOREACH, FUSED, update_path
from ._policy_optimizer import PolicyOptimizer
from ._report import warn_at_caller, weak_combination
from .rules import StateSpec, UpdateRule

__all__ = ["QuantizedOptimizer"]


class QuantizedOptimizer(PolicyOptimizer):
    """Base of qstate's elementwise optimizers. A subclass sets :attr:`rule` (a registered
    :class:`~qstate.optim.rules.UpdateRule`), passes its hyperparameters as ``defaults`` and the
    policy keywords (:class:`~qstate.optim.StatePolicy`) to ``__init__``, and overrides
    :meth:`rule_flags` where its rule has static flags beyond ``maximize``."""

    rule: UpdateRule
    #: whether the optimizer warned of a weak combination (:meth:`_warn_weak`)
    _warned_weak = False

    def rule_flags(self, group: dict) -> dict:
        """The rule's static flags for ``group``: Python values that choose its math (each set of them is
        traced and compiled apart, so never a per-step value). Default: ``{"maximize": group["maximize"]}``
        (False where the group has no ``maximize``)."""
        return {"maximize": bool(group.get("maximize", False))}

    def add_param_group(self, param_group: dict) -> None:
        """:meth:`PolicyOptimizer.add_param_group`, then a warning if the group's format is weak for the rule."""
        super().add_param_group(param_group)
        self._warn_weak(self.param_groups[-1])

    def _warn_weak(self, group: dict) -> None:
        """Warn, once per optimizer, if ``group``'s format is documented weak for this optimizer's rule
        (:data:`~._report.WEAK_COMBINATIONS`)."""
        message = weak_combination(type(self).__name__, self.rule.name, group["state_format"])
        if message is not None and not self._warned_weak:
            self._warned_weak = True
            warn_at_caller(message)

    def _state_specs(self, group: dict) -> Sequence[StateSpec]:
        return self.rule.states(self.rule_flags(group))

    def _prepare_group(self, group: dict, params: list[Tensor], states: list[list[Tensor]], steps: list[Tensor],
                       grad_scale: Optional[Tensor], indices: list[int]) -> _step.PendingUpdate:
        path = update_path(group, self.compile)
        return _step.prepare_update(self.rule, self.rule_flags(group), params, [p.grad for p in params], states,
                                    steps, group, lr=group["lr"], compile=path == FUSED, foreach=path == FOREACH,
                                    stochastic_round=group["bf16_stochastic_round"], grad_scale=grad_scale,
                                    owner=type(self).__name__, indices=indices)

"""Optimizers with quantized states: ``AdamW``, ``Adam``, ``Lion``, ``SGD``, ``Muon`` and their functional forms.

``qstate.optim.functional.{adam, adamw, lion, sgd}`` and
``qstate.optim.muon.muon`` update caller-owned states; the classes are
``torch.optim.Optimizer`` subclasses sharing one base,
:class:`QuantizedOptimizer` (state policy, lr handling, stochastic rounding,
state_dict; :func:`convert_state_dict` rewrites a state dict for another
policy or for ``torch.optim``). The elementwise update math of each lives
once in ``_rules.py`` and runs either as fused compiled kernels
(``_kernels.py``: inductor, or on CPU a hand-written C kernel for quantized
states, ``_cpu_kernel.py``) or eagerly op by op. Muon's update is not
elementwise: it lives in ``muon.py`` and runs op by op.
"""

from . import functional
from ._cpu_kernel import cpu_kernel_enabled
from ._base import PLAIN_FORMATS, POLICY_OPTIONS, STATE_FORMATS, QuantizedOptimizer
from ._convert import convert_state_dict
from ._kernels import kernel_kinds
from ._rounding import stochastic_round_bf16
from ._rules import adam_bound, adam_update_bound
from .muon import Muon
from .optimizers import SGD, Adam, AdamW, Lion

__all__ = [
    "AdamW", "Adam", "Lion", "SGD", "Muon", "QuantizedOptimizer", "functional", "STATE_FORMATS", "PLAIN_FORMATS",
    "POLICY_OPTIONS", "convert_state_dict", "kernel_kinds", "cpu_kernel_enabled", "stochastic_round_bf16",
    "adam_bound", "adam_update_bound",
]

"""Optimizers with quantized states: ``AdamW``, ``Adam``, ``AdEMAMix``, ``Lion``, ``SGD``, ``Muon`` and their
functional forms.

One file per optimizer (``adam.py``, ``ademamix.py``, ``lion.py``, ``sgd.py``, ``muon.py``) holds its
update rule's math, its ``torch.optim.Optimizer`` class and its functional form;
``qstate.optim.functional`` collects the functional forms, which update caller-owned states. The
classes share one state policy, :class:`StatePolicy` (the keywords every optimizer takes besides its
hyperparameters, documented there), and one step; the elementwise ones one base,
:class:`QuantizedOptimizer` (the base of a rule of one's own); :func:`convert_state_dict` rewrites a
state dict for another policy or for ``torch.optim``. Elementwise rules (an
:class:`~.rules.UpdateRule`, registered by name) step through the engine (``_engine``, private),
whose fused kernels are the C kernel on CPU and inductor's elsewhere. Muon's update is not
elementwise (Newton-Schulz of the whole matrix): it runs op by op on the parameter, a DTensor
included, and its other parameters step as AdamW.

The public names are the optimizers, ``functional``, the state policy, the base class, what a rule of
one's own needs (:class:`UpdateRule`, :class:`StateSpec`, :func:`register_rule`),
:func:`convert_state_dict`, the C kernel's switch (:func:`cpu_kernel_enabled`), bfloat16 stochastic
rounding and Adam's update bounds.
"""

from . import functional
from ._engine import cpu_kernel_enabled, stochastic_round_bf16
from ._base import QuantizedOptimizer
from ._policy import STATE_FORMATS, StatePolicy
from ._convert import convert_state_dict
from .rules import StateSpec, UpdateRule, register_rule
from .adam import Adam, AdamW, adam_bound, adam_update_bound
from .ademamix import AdEMAMix
from .lion import Lion
from .muon import Muon
from .sgd import SGD

__all__ = [
    "AdamW", "Adam", "AdEMAMix", "Lion", "SGD", "Muon", "QuantizedOptimizer", "functional", "STATE_FORMATS",
    "convert_state_dict", "cpu_kernel_enabled", "stochastic_round_bf16", "adam_bound", "adam_update_bound",
    "StateSpec", "UpdateRule", "register_rule", "StatePolicy",
]

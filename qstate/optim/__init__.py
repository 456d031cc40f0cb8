"""Optimizers with quantized states: ``AdamW``, ``Adam``, ``AdEMAMix``, ``Lion``, ``SGD``, ``Muon`` and their
functional forms.

One file per optimizer (``adam.py``, ``ademamix.py``, ``lion.py``, ``sgd.py``, ``muon.py``) holds its
update rule's math, its ``torch.optim.Optimizer`` class and its functional form;
``qstate.optim.functional`` collects the functional forms, which update caller-owned states. The
classes share one state policy, :class:`StatePolicy` (the keywords every optimizer takes besides its
hyperparameters, documented there), and one step; the elementwise ones one base,
:class:`QuantizedOptimizer` (the base of a rule of one's own); :func:`convert_state_dict` rewrites a
state dict for another policy or for ``torch.optim``. Elementwise rules (an
:class:`~.rules.UpdateRule`, registered by name) step through ``_step.apply_update``: with
``compile=True`` one ``qstate::fused_update`` call per device and variant, whose kernels (the C kernel
on CPU, inductor's, or the rule's math op by op) are chosen in ``_fused_op.py``. Muon's update is not
elementwise (Newton-Schulz of the whole matrix): it runs op by op on the parameter, a DTensor
included, and its other parameters step as AdamW.

The public names are the optimizers, ``functional``, the state policy, the base class, what a rule of
one's own needs (:class:`UpdateRule`, :class:`StateSpec`, :func:`register_rule`),
:func:`convert_state_dict`, the C kernel's switch (:func:`cpu_kernel_enabled`), bfloat16 stochastic
rounding and Adam's update bounds.
The kernels' building blocks (state kinds, kernel specs, codecs, draws) are the engine's, private.
"""

from . import _cpu_encode  # noqa: F401  (registers the C kernel's encode of CPU states)
from . import functional
from ._cpu_kernel import cpu_kernel_enabled
from ._base import QuantizedOptimizer
from ._policy import STATE_FORMATS, StatePolicy
from ._convert import convert_state_dict
from ._param_rounding import stochastic_round_bf16
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

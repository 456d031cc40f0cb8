"""Optimizers with quantized states: ``AdamW``, ``Adam``, ``AdEMAMix``, ``Lion``, ``SGD``, ``Muon`` and their
functional forms.

One file per optimizer (``adam.py``, ``ademamix.py``, ``lion.py``, ``sgd.py``, ``muon.py``) holds its
update rule's math, its ``torch.optim.Optimizer`` class and its functional form;
``qstate.optim.functional`` collects the functional forms, which update caller-owned states. The
classes share one base, :class:`QuantizedOptimizer` (state policy, lr handling, stochastic rounding,
state_dict; :func:`convert_state_dict` rewrites a state dict for another policy or for
``torch.optim``). Elementwise rules (an :class:`~._rules.UpdateRule`, registered by name) step
through ``_step.apply_update``: with ``compile=True`` one ``qstate::fused_update`` call per device
and variant, whose kernels (the C kernel on CPU, inductor's, or the rule's math op by op) are chosen in
``_fused_op.py``. Muon's update is not elementwise (Newton-Schulz of the whole matrix): it runs op
by op on the parameter, a DTensor included, and its other parameters step as AdamW.

Building blocks for writing rules and kernels of one's own (what the fused kernels and their tests use):
:class:`StateKind` (the kind of one state) and :class:`KernelSpec` (what one kernel is built for: a rule,
its flags and its states' kinds), :func:`fusable` (whether the fused kernels take an update's tensors),
:func:`get_codec` (a format's per-element :class:`Codec`, the kernels' encode/decode) and
:func:`code_thresholds` (a code map's rounding thresholds), and the stochastic-rounding draws
:func:`position_draws` / :func:`key_draws` that :func:`stochastic_round_bf16` takes.
"""

from . import functional
from ._cpu_kernel import cpu_kernel_enabled
from ._codec import Codec, get_codec
from ._codec import _code_thresholds as code_thresholds
from ._base import PLAIN_FORMATS, POLICY_OPTIONS, STATE_FORMATS, QuantizedOptimizer
from ._convert import convert_state_dict
from ._fused_op import fused_variant
from ._kernels import KernelSpec, fusable, kernel_specs
from ._rounding import key_draws, position_draws, stochastic_round_bf16
from ._rules import StateSpec, UpdateRule, register_rule
from ._state_kind import StateKind
from .adam import Adam, AdamW, adam_bound, adam_update_bound
from .ademamix import AdEMAMix
from .lion import Lion
from .muon import Muon
from .sgd import SGD

__all__ = [
    "AdamW", "Adam", "AdEMAMix", "Lion", "SGD", "Muon", "QuantizedOptimizer", "functional", "STATE_FORMATS",
    "PLAIN_FORMATS", "POLICY_OPTIONS", "convert_state_dict", "kernel_specs", "cpu_kernel_enabled", "fused_variant",
    "stochastic_round_bf16", "adam_bound", "adam_update_bound", "StateSpec", "UpdateRule", "register_rule",
    "StateKind", "KernelSpec", "fusable", "Codec", "get_codec", "code_thresholds", "position_draws", "key_draws",
]

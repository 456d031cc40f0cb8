"""qstate: quantized optimizer state that DTensor and FSDP2 run natively.

Public API: :class:`QuantizedState` (its views along dims other than 0: :class:`QuantizedStateView`),
:func:`quantize`, :func:`zeros_like`, ``QuantizedState.dequantize()``, :func:`dequantize`, :func:`update_states`
(op-by-op updates with one encode per state), ``QuantizedState.storage_nbytes()``, the
format registry :mod:`qstate.formats`, the op table :mod:`qstate.ops` and the
DTensor sharding rules :mod:`qstate.dtensor_rules`. Optimizers live in
:mod:`qstate.optim`, gradient scaling in :mod:`qstate.amp`, all-or-nothing DCP
loading in :mod:`qstate.checkpoint`.

Importing qstate (1) registers :class:`QuantizedState` and its rebuild
function as ``torch.load(weights_only=True)`` safe globals and (2) registers
the DTensor rules of qstate's own operators (``qstate::fused_update``,
``qstate::flat_index_like``, ``qstate::stochastic_round_bf16``,
``qstate::copy_with_draws_``), which is all
qstate's states and optimizers need. It changes no DTensor rule of a torch op:
qstate's replacements of those (the upstream patch series, applied at run
time) are opt-in, :func:`qstate.dtensor_rules.install`. (3) It imports
:mod:`qstate.optim`, which registers the C kernel's encode and decode of CPU
states (:mod:`qstate._state_kernels`); inductor's compiled ones serve CUDA states.
"""

import torch

from . import formats
from ._api import dequantize, quantize, row_layout, zeros_like
from .distributed import DEFAULT_MIN_QUANTIZE_NUMEL, state_like, wants_quantized
from ._state import QuantizedState, _rebuild_quantized_state
from ._state_view import QuantizedStateView
from ._update_states import update_states
from . import _compiled_codec  # noqa: F401  (inductor's encode and decode of CUDA states)
from . import ops  # noqa: F401  (fills the dispatch table)
from . import dtensor_rules

__all__ = ["QuantizedState", "QuantizedStateView", "quantize", "dequantize", "update_states", "zeros_like", "state_like", "wants_quantized",
           "DEFAULT_MIN_QUANTIZE_NUMEL", "row_layout", "formats", "ops", "dtensor_rules", "SAFE_GLOBALS"]
__version__ = "0.1.0"

#: what ``import qstate`` adds to ``torch.serialization``'s safe globals
SAFE_GLOBALS = [QuantizedState, _rebuild_quantized_state]
torch.serialization.add_safe_globals(SAFE_GLOBALS)
dtensor_rules.register_qstate_ops()
from . import optim  # noqa: E402,F401  (registers its kernels: the C encode of CPU states)

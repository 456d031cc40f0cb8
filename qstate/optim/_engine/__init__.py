"""The update engine: how an elementwise :class:`~qstate.optim.rules.UpdateRule` updates parameters and
their states, plain, quantized or DTensor-wrapped.

Its door is :func:`apply_update` (and :func:`prepare_update`, which checks a whole update and writes
nothing, then :meth:`PendingUpdate.run`); the path each parameter takes is chosen in one place,
:mod:`.path`. The operator ``qstate::fused_update`` (:mod:`.op`) runs the fused kernels of the
backends (:mod:`.backends`): inductor's compiled kernels (:mod:`.inductor`) on every device and the C
kernel (:mod:`.cpu`) on CPU, which registers itself on import; without the :mod:`.cpu` folder and its
import below, the engine runs inductor's kernels with the same results bit for bit. Every path draws
its stochastic rounding by each element's place in the full tensor (:mod:`qstate._random`), so the
same update gives the same bits on any path, layout and number of ranks.
"""

from . import inductor  # noqa: F401  (registers the default backend)
from . import cpu  # noqa: F401  (registers the C kernel: the CPU's backend and its state codecs)
from .backends import cpu_kernel_enabled
from .eager import update_eagerly, write_states
from .param_rounding import stochastic_round_bf16
from .spec import StateKind
from .step import (PendingUpdate, Scalar, apply_update, check_grad, check_lists, next_step, prepare_update,
                   skip_step, unscale_factor)

__all__ = ["PendingUpdate", "Scalar", "StateKind", "apply_update", "check_grad", "check_lists", "cpu_kernel_enabled",
           "next_step", "prepare_update", "skip_step", "stochastic_round_bf16", "unscale_factor", "update_eagerly",
           "write_states"]

"""The C kernel: the CPU's fused backend and its encode and decode of CPU states.

Importing this package registers both (:func:`~..backends.register_backend` for ``"cpu"``,
:func:`qstate._state_kernels.register_state_kernels`); the engine imports it once. Without it the
CPU runs inductor's kernels and the formats' torch codecs, with the same results bit for bit.
"""

from ...._state_kernels import register_state_kernels
from ..backends import register_backend
from .kernel import C_KERNEL
from .state_kernels import CPUStateKernels

register_backend(C_KERNEL, "cpu")
register_state_kernels("cpu", CPUStateKernels())

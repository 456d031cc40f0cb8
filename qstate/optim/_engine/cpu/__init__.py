"""The C kernel: the CPU's fused backend and its encode and decode of CPU states.

Importing this package registers them: the backend for ``"cpu"`` (:func:`~..backends.register_backend`),
the states' encode and decode (:func:`qstate._state_kernels.register_state_kernels`) and the CPU
kernels of ``qstate::encode_into_``/``qstate::decode`` (which compiled code calls); the engine imports
it once. Without it the CPU runs inductor's kernels and the formats' torch codecs, with the same
results bit for bit.
"""

from ...._library import LIBRARY
from ...._state_kernels import register_state_kernels
from ..backends import register_backend
from .kernel import C_KERNEL
from .state_kernels import KERNELS, decode_cpu, encode_into_cpu

register_backend(C_KERNEL, "cpu")
register_state_kernels("cpu", KERNELS)
LIBRARY.impl("encode_into_", encode_into_cpu, "CPU")
LIBRARY.impl("decode", decode_cpu, "CPU")

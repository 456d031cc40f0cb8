"""The fused kernels' backends: which one runs a kernel spec on a device.

A backend (:class:`FusedBackend`) runs one fused update of a parameter and its states (decode, the
rule's math, encode in one pass) for the kernel specs it takes, and leaves a prepared call of it for
later steps. Backends are registered per device type and asked in registration order; the default
backend (registered with ``device_type=None``: inductor's compiled kernels) takes every spec on
every device and is asked last. :func:`backend_for` is the only place that asks them.

A switch (:func:`cpu_kernel_enabled`) turns the C kernel (the backend named ``"c"``) off and on;
a turned-off backend takes nothing. Every registration and switch bumps :data:`GENERATION`; a
prepared call is valid only under the generation it was built in.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Protocol, Sequence

import torch
from torch import Tensor

__all__ = ["GENERATION", "FusedBackend", "register_backend", "backend_for", "default_backend", "cpu_kernel_enabled"]


class FusedBackend(Protocol):
    """What a backend provides. ``supports`` is a function of the kernel spec and the gradients' dtype
    (asked every step: memoize it); ``run`` updates ``p`` and ``states`` in place (``key``: the
    stochastic-rounding key of a spec that draws, None: drawn now; ``start``: the flat index of ``p``'s
    first element in the full tensor it is a shard of) and registers the call's prepared form."""

    name: str

    def supports(self, spec, grad_dtype: torch.dtype) -> bool: ...

    def run(self, spec, p: Tensor, g: Tensor, states: Sequence[Tensor], hyper: Tensor, key: Optional[int],
            start: int) -> None: ...


#: device type -> backends asked before the default one, in registration order
_BY_DEVICE: dict[str, list[FusedBackend]] = {}
#: the backend asked last on every device
_DEFAULT: list[FusedBackend] = []
#: names of the backends turned off (:func:`cpu_kernel_enabled`)
_OFF: set[str] = set()
#: bumped by every registration and switch: a prepared call is valid while it is the one it was built under
GENERATION = [0]


def register_backend(backend: FusedBackend, device_type: Optional[str] = None) -> FusedBackend:
    """Register ``backend`` for ``device_type`` (None: the default backend, which must take every spec)."""
    if device_type is None:
        _DEFAULT[:] = [backend]
    else:
        _BY_DEVICE.setdefault(device_type, []).append(backend)
    GENERATION[0] += 1
    return backend


def backend_for(spec, device_type: str, grad_dtype: torch.dtype) -> FusedBackend:
    """The backend that runs ``spec`` with gradients of ``grad_dtype`` on ``device_type``."""
    for backend in _BY_DEVICE.get(device_type, ()):
        if backend.name not in _OFF and backend.supports(spec, grad_dtype):
            return backend
    return _DEFAULT[0]


def default_backend() -> FusedBackend:
    """The backend asked last on every device (inductor's compiled kernels)."""
    return _DEFAULT[0]


def _switch(name: str, on: bool) -> None:
    if on:
        _OFF.discard(name)
    else:
        _OFF.add(name)
    GENERATION[0] += 1


@contextlib.contextmanager
def cpu_kernel_enabled(enabled: bool):
    """Within the block, the C kernel takes the CPU kernel specs it supports (``True``) or none
    (``False``, they run inductor's kernels)."""
    before = "c" not in _OFF
    _switch("c", bool(enabled))
    try:
        yield
    finally:
        _switch("c", before)

"""Functional optimizer steps over caller-owned states: ``adam``, ``adamw``, ``ademamix``, ``lion``, ``sgd``,
``muon``.

Each function updates ``params`` and their states in place, like ``torch.optim``'s functional
API. States may be plain tensors (float32 or bfloat16), :class:`~qstate.QuantizedState` (build them
with ``qstate.zeros_like(p, fmt, signed=..., dtype=torch.float32)``; second moments unsigned; the
optimizers give ``4bit`` first moments ``rounding="stochastic"``) or DTensors over either. Each
quantized state is written with its own rounding mode. Other optimizer libraries can call these
with their own state tensors, or :func:`apply_update` with their own
:class:`~qstate.optim.rules.UpdateRule`. Each function lives with its optimizer's rule and class
(``adam.py``, ``ademamix.py``, ``lion.py``, ``sgd.py``, ``muon.py``); the paths an update takes are chosen in ``_engine/path.py``.
"""

from ._engine import apply_update
from .adam import adam, adamw
from .ademamix import ademamix
from .lion import lion
from .muon import muon
from .sgd import sgd

__all__ = ["adam", "adamw", "ademamix", "apply_update", "lion", "muon", "sgd"]

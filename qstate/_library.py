"""The ``qstate`` operator namespace (``torch.ops.qstate``).

Schemas only: each op's kernels are registered by the module that owns its
math, and its handlers by :mod:`qstate.ops` (QuantizedState) and
:mod:`qstate.dtensor_rules` (DTensor), so those packages can name the op
without importing the optimizers.

* ``fused_update(param, grad, states, hyper, kind)``: one optimizer update of
  ``param`` and its ``states`` in place (kernels: :mod:`qstate.optim._fused_op`).
  ``hyper`` is the update rule's scalar vector, ``kind`` names the rule, its
  static flags, stochastic rounding and compilation.
"""

from __future__ import annotations

import torch

__all__ = ["LIBRARY", "fused_update"]

#: the ``qstate`` namespace; lives as long as the process (torch has no way to drop a namespace)
LIBRARY = torch.library.Library("qstate", "DEF")
LIBRARY.define("fused_update(Tensor(a!) param, Tensor grad, Tensor(b!)[] states, Tensor hyper, str kind) -> ()")

fused_update = torch.ops.qstate.fused_update.default

"""Rules of other libraries: an ``UpdateRule`` of their own math steps qstate's states on every path."""

from __future__ import annotations

import pytest
import torch

import qstate
from qstate.optim import functional as F


def test_a_library_rule_runs_on_every_path_through_apply_update():
    """Another library's elementwise rule (here sign-SGD with momentum) steps qstate's states through
    ``functional.apply_update``: eagerly and fused, on plain and 8bit states, as its plain-PyTorch math."""
    from qstate.optim import StateSpec, UpdateRule, register_rule

    def math_(p, g, states, h, flags):
        buf = states[0] * h["momentum"] + g
        return p - h["lr"] * buf.sign(), [buf]

    rule = UpdateRule("test_signum", lambda flags: (StateSpec("momentum_buffer", True),),
                      ("lr", "grad_unscale", "momentum"), lambda group, step: {"momentum": group["momentum"]},
                      math_)
    with pytest.raises(ValueError, match="'test_signum' is not registered"):
        F.apply_update(rule, {}, [], [], [], [], {"momentum": 0.9}, lr=0.1)
    register_rule(rule)
    torch.manual_seed(0)
    p0, grads = torch.randn(300, 301), [torch.randn(300, 301) for _ in range(3)]
    ref, buf = p0.clone(), torch.zeros_like(p0)
    for g in grads:
        buf = buf * 0.9 + g
        ref = ref - 0.1 * buf.sign()
    for fmt in ("fp32", "8bit"):
        for compile in (False, True):
            p = p0.clone()
            state = torch.zeros_like(p) if fmt == "fp32" else qstate.zeros_like(p, fmt, signed=True,
                                                                                dtype=torch.float32)
            for step, g in enumerate(grads, 1):
                F.apply_update(rule, {}, [p], [g], [[state]], [step], {"momentum": 0.9}, lr=0.1, compile=compile)
            if fmt == "fp32":
                torch.testing.assert_close(p, ref, rtol=0, atol=1e-6)
            else:  # the buffer's quantization error may flip a sign near zero
                assert (p - ref).abs().gt(1e-4).float().mean() < 0.02

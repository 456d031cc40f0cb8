"""Other optimizer libraries' optimizers stepping on swapped-in 8bit states (the real packages, on CPU).

A library's optimizer takes one step with its own fp32 states; every state of 64 or more elements is then
replaced by ``qstate.quantize(state, "8bit")`` (unsigned for second moments, whose names hold ``sq``) and
the optimizer keeps stepping through qstate's ops on the states, as the author of another library would
use them: the states stay quantized, and the parameters stay within 8bit's bound of the same optimizer's
fp32 run. torch.optim's AdamW, for-loop and foreach, is the baseline.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import qstate

from trainer_packages import require

heavyball = require("heavyball")
pytorch_optimizer = require("pytorch_optimizer")

STEPS = 6
#: relative parameter error of 8bit moments after STEPS steps at lr 1e-2 (measured about 3e-3 to 5e-3)
BOUND = 2e-2

OPTIMIZERS: dict[str, Callable[[list], Any]] = {
    "torch AdamW, for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "torch AdamW, foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "heavyball AdamW": lambda ps: heavyball.AdamW(ps, lr=1e-2),
    "pytorch_optimizer Adan": lambda ps: pytorch_optimizer.Adan(ps, lr=1e-2),
    "pytorch_optimizer AdamP": lambda ps: pytorch_optimizer.AdamP(ps, lr=1e-2),
}


def _swap(state: dict) -> list[str]:
    """Quantize ``state``'s tensors (nested dicts too, as heavyball keeps them) in place; their keys."""
    swapped = []
    for key, value in list(state.items()):
        if isinstance(value, dict):
            swapped += _swap(value)
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() >= 64:
            state[key] = qstate.quantize(value, "8bit", signed="sq" not in str(key))
            swapped.append(str(key))
    return swapped


def _states(state: dict) -> list[torch.Tensor]:
    out = []
    for value in state.values():
        out += _states(value) if isinstance(value, dict) else [value] if isinstance(value, torch.Tensor) else []
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_library_optimizer_steps_on_swapped_in_8bit_states(name: str) -> None:
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 128))
    ref = torch.nn.Parameter(w.detach().clone())
    opt, ref_opt = make([w]), make([ref])
    x = torch.randn(16, 64)
    for step in range(STEPS):
        for p, o in ((w, opt), (ref, ref_opt)):
            o.zero_grad()
            (x @ p).square().mean().backward()
            o.step()
        if step == 0:
            swapped = [k for st in opt.state.values() for k in _swap(st)]
            assert swapped, f"{name}: no state to swap"
    quantized = [s for st in opt.state.values() for s in _states(st) if isinstance(s, qstate.QuantizedState)]
    assert len(quantized) == len(swapped), f"{name}: a state stopped being quantized"
    error = ((w - ref).abs().max() / ref.abs().max()).item()
    assert error < BOUND, f"{name}: parameters {error:.2e} from the fp32 run"

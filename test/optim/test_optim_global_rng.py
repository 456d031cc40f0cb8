"""No hidden draws: building and stepping a qstate optimizer leave torch's global generators as they were,
so a training run sees the random numbers (dropout masks, data order) of the same run with torch.optim.

HF Trainer calls ``set_seed`` before it builds the optimizer: an optimizer that drew its seed from the
global generator moved every later dropout mask. The stochastic-rounding stream is the optimizer's own
(a seed from a private generator seeded with ``torch.initial_seed()``, or given), and its draws run on
generators restored after each group's update.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qstate.optim import SGD, AdEMAMix, Adam, AdamW, Lion, Muon
from test_optim_cases import grads

#: optimizers and options that draw (stochastic states, bf16 stochastic rounding) on each path
CONFIGS = [
    (AdamW, dict(state_format="4bit")),
    (AdamW, dict(state_format="4bit", foreach=True)),
    (AdamW, dict(state_format="8bit", state_rounding="stochastic", fused=False, foreach=False)),
    (AdamW, dict(state_format="8bit", bf16_stochastic_round=True)),
    (Adam, dict(state_format="4bit", amsgrad=True)),
    (SGD, dict(state_format="4bit", momentum=0.9)),
    (Lion, dict(state_format="4bit")),
    (AdEMAMix, dict(state_format="4bit", foreach=True)),
    (Muon, dict(state_format="4bit")),
    (AdamW, dict(state_format="fp32", compile=False)),
]


def _generator_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states += torch.cuda.get_rng_state_all()
    return states


def _unchanged(before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _generator_states(), strict=True))


def _params(dtype: torch.dtype) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(64, 128), (40, 30), (128,)]]


@pytest.mark.parametrize("cls, options", CONFIGS, ids=[f"{c.__name__}-{o}" for c, o in CONFIGS])
def test_building_and_stepping_leave_the_global_generators_untouched(cls, options):
    dtype = torch.bfloat16 if options.get("bf16_stochastic_round") else torch.float32
    ps = _params(dtype)
    torch.manual_seed(0)
    before = _generator_states()
    opt = cls(ps, lr=1e-3, min_quantize_numel=0, **options)
    assert _unchanged(before), "building the optimizer drew from a global generator"
    for step in range(2):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
        assert _unchanged(before), f"step {step + 1} drew from a global generator"


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.Dropout(0.5), nn.ReLU(), nn.Linear(128, 4))

    def forward(self, x):
        return self.body(x)


def _masks_of_a_run(build) -> list[torch.Tensor]:
    """As HF Trainer runs: set the seed, build the model, then the optimizer, then train; the dropout
    masks and a draw after each step."""
    torch.manual_seed(42)
    model = _Net()
    opt = build(model.parameters())
    seen = []
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for _ in range(3):
        hidden = model.body[0](x)
        mask = model.body[1](torch.ones_like(hidden))
        loss = nn.functional.cross_entropy(model.body[3](model.body[2](hidden * mask)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen += [mask.detach(), torch.rand(4)]
    return seen


@pytest.mark.parametrize("options", [dict(state_format="4bit"), dict(state_format="8bit", foreach=True),
                                     dict(state_format="4bit", fused=False, foreach=False)], ids=str)
def test_dropout_masks_equal_a_torch_optim_run(options):
    ref = _masks_of_a_run(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    ours = _masks_of_a_run(lambda ps: AdamW(ps, lr=1e-3, min_quantize_numel=0, **options))
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))

"""AdEMAMix: parity with a plain-PyTorch copy of the published algorithm, on every path and format.

The reference is the authors' ``AdEMAMix.step`` (``apple/ml-ademamix``, ``ademamix.py``), restated
over plain tensors as ``optim_db.AdEMAMixReference``. FSDP2 parity runs in ``test_optim_db.py`` with the
other optimizers.
"""

from __future__ import annotations

import pytest
import torch

import qstate
from qstate.optim import AdEMAMix, functional as F

from optim_db import AdEMAMixReference

_SHAPES = [(300, 301), (40, 50), (64,)]  # a fused kernel's size, a small matrix, a bias


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s)) for s in _SHAPES]


def _grads(step):
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=gen) for s in _SHAPES]


SETTINGS = [
    dict(betas=(0.9, 0.999, 0.9999), alpha=2.0, beta3_warmup=None, alpha_warmup=None, weight_decay=0.0),
    dict(betas=(0.9, 0.99, 0.999), alpha=5.0, beta3_warmup=4, alpha_warmup=3, weight_decay=0.1),
    dict(betas=(0.0, 0.99, 0.999), alpha=8.0, beta3_warmup=None, alpha_warmup=None, weight_decay=0.01),  # no fast EMA
]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("setting", SETTINGS, ids=["defaults", "warmups+wd", "beta1=0"])
def test_fp32_states_match_the_published_algorithm(setting, compile):
    lr, eps = 1e-2, 1e-8
    ps, ref = _params(), _params()
    opt = AdEMAMix(ps, lr=lr, eps=eps, state_format="fp32", compile=compile, **setting)
    ref_opt = AdEMAMixReference(ref, lr=lr, eps=eps, **setting)
    ref_states = ref_opt.state
    for step in range(6):
        for p, q, g in zip(ps, ref, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for p, q in zip(ps, ref):
            if compile:  # the compiled kernels may contract or reassociate
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            else:  # op for op the same math
                assert torch.equal(p, q)
    names = ["exp_avg_slow", "exp_avg_sq"] + (["exp_avg_fast"] if setting["betas"][0] else [])
    for p, q in zip(ps, ref):
        assert sorted(n for n in opt.state[p] if n != "step") == sorted(names)
        for n in names:
            torch.testing.assert_close(opt.state[p][n], ref_states[q][n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_format", ["8bit", "4bit", "fp8"])
def test_quantized_states_are_the_published_step_of_their_decoded_values(state_format):
    # one step from quantized states equals the published step (fp32) from the states' decoded values,
    # re-encoded: compare parameters closely and the states through the same quantization
    lr, setting = 1e-2, SETTINGS[1]
    ps = _params()
    opt = AdEMAMix(ps, lr=lr, state_format=state_format, min_quantize_numel=1024, compile=False, **setting)
    for step in range(3):
        for p, g in zip(ps, _grads(step)):
            p.grad = g.clone()
        opt.step()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref_states = {q: {"step": int(opt.state[p]["step"]),
                      **{n: (s.dequantize() if isinstance(s, qstate.QuantizedState) else s.clone())
                         for n, s in opt.state[p].items() if n != "step"}}
                  for p, q in zip(ps, ref)}
    for p, q, g in zip(ps, ref, _grads(3)):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    ref_opt = AdEMAMixReference(ref, lr=lr, eps=1e-8, **setting)
    for q in ref:
        ref_opt.state[q] = ref_states[q]
    ref_opt.step()
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for n, s in opt.state[p].items():
            if isinstance(s, qstate.QuantizedState):
                want = qstate.quantize(ref_states[q][n], state_format, signed=s.signed, block_size=s.block_size,
                                       rounding=s.rounding).dequantize()
                if s.rounding == "nearest":
                    assert torch.equal(s.dequantize(), want), n


def test_fused_equals_eager_on_quantized_states_and_converges():
    # the C kernel / inductor kernel and the op-by-op math agree to float rounding on 8bit states,
    # and the loss of a least-squares problem falls as with fp32 states
    torch.manual_seed(0)
    a = torch.randn(256, 64)
    b = a @ (0.5 * torch.randn(64, 1)) + 0.01 * torch.randn(256, 1)
    losses = {}
    for fmt in ("fp32", "8bit"):
        for compile in (False, True):
            w = torch.nn.Parameter(torch.zeros(64, 1))
            opt = AdEMAMix([w], lr=1e-2, state_format=fmt, min_quantize_numel=1, compile=compile, alpha=2.0,
                           betas=(0.9, 0.99, 0.999))
            for _ in range(100):
                loss = (a @ w - b).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses[fmt, compile] = float((a @ w - b).square().mean().detach())
    start = float(b.square().mean())
    for key, value in losses.items():
        assert value < 0.05 * start, (key, value, start)
    assert abs(losses["8bit", True] - losses["8bit", False]) < 1e-3 * start
    assert losses["8bit", True] < 1.5 * losses["fp32", True]


def test_functional_form_equals_the_class():
    setting = SETTINGS[1]
    ps, qs = _params(), _params()
    opt = AdEMAMix(ps, lr=1e-2, state_format="fp32", compile=False, **setting)
    fast = [torch.zeros_like(q) for q in qs]
    slow = [torch.zeros_like(q) for q in qs]
    sq = [torch.zeros_like(q) for q in qs]
    steps = [torch.tensor(0.0) for _ in qs]
    beta1, beta2, beta3 = setting["betas"]
    for step in range(4):
        grads = _grads(step)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            F.ademamix(qs, grads, fast, slow, sq, steps, lr=1e-2, beta1=beta1, beta2=beta2, beta3=beta3,
                       alpha=setting["alpha"], eps=1e-8, weight_decay=setting["weight_decay"],
                       beta3_warmup=setting["beta3_warmup"], alpha_warmup=setting["alpha_warmup"])
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kwargs, message", [
    (dict(betas=(0.9, 0.999)), "AdEMAMix: invalid betas (0.9, 0.999): expected three values in [0, 1)"),
    (dict(alpha=-1.0), "AdEMAMix: invalid alpha value: -1.0"),
    (dict(beta3_warmup=0), "AdEMAMix: invalid beta3_warmup: 0: expected None or a positive int"),
    (dict(state_format="3bit"), "state_format"),
])
def test_bad_arguments_raise_and_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        AdEMAMix(_params(), **kwargs)


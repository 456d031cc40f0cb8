"""Update rules whose C the CPU kernel generates from their math (``qstate/optim/_cpu_rule.py``).

AdEMAMix (qstate's) and Adan (a third party's rule, registered through the
public API only, ``adan_rule.py``: ``UpdateRule``, ``StateSpec``, ``register_rule``, ``QuantizedOptimizer``) run the C
kernel, with the inductor kernel's results bit for bit (``cpu_kernel_enabled(False)`` runs inductor's), on
8bit, 4bit, fp8 and plain float32 states, shapes whose rows end in partial blocks, and on FSDP2 against the
unsharded run. Plain float32 states are also compared with the rule's math run op by op on whole tensors
with float32 scalars (eager ATen kernels: bit for bit) and with the published algorithms (to float
rounding). A rule the generator does not take keeps inductor's kernel, and says so.
"""

from __future__ import annotations

import logging

import expecttest
import pytest
import torch

import qstate
from qstate.optim import QuantizedOptimizer, StateSpec, UpdateRule, cpu_kernel_enabled, register_rule
from qstate.optim import functional as F
from qstate.optim._engine.cpu import kernel as _cpu_kernel, rule_source as _cpu_rule
from qstate.optim._engine.spec import KernelSpec
from qstate.optim.rules import RULES

from adan_rule import ADAN, Adan, adan_math, adan_reference_step

#: rows ending in a partial block, rows of several segments ending in a partial one, a one-row matrix
SHAPES = [(33, 71), (7, 513), (2, 2100), (1, 300)]
#: plain-state shapes: 65536 elements or more, so that with the C kernel off inductor's kernel runs them
PLAIN_SHAPES = [(300, 301), (70_001,)]
SR = "stochastic"
PLAIN = {"fp32": torch.float32}


# ------------------------------------------------------------------ helpers
def _grads(shapes, gen, dtype=torch.float32):
    # tiny and huge magnitudes in one block: codes across the whole map
    return [(torch.randn(s, generator=gen) * 10 ** (6 * torch.rand(s, generator=gen) - 3)).to(dtype)
            for s in shapes]


def _assert_same_bits(got, want, what: str) -> None:
    if isinstance(want, qstate.QuantizedState):
        assert got.describe() == want.describe(), what
        assert torch.equal(got.codes, want.codes), f"{what}: codes differ"
        assert torch.equal(got.scale, want.scale), f"{what}: scales differ"
        return
    assert got.dtype == want.dtype, what
    same = (got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32)
            == want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))
    assert bool(same.all()), f"{what}: {int((~same).sum())} elements differ"


def _assert_c_kernel_takes(rule: str, flags: dict, p: torch.Tensor, states: list, sr: bool = False) -> None:
    """That the C kernel takes the update of ``p`` and ``states`` (not inductor's kernel: the comparisons
    would compare inductor with itself)."""
    spec = KernelSpec.of(rule, tuple(sorted(flags.items())), p, states, sr)
    assert _cpu_kernel.supports(spec, p.dtype), f"the C kernel does not take {spec.tag()}"


# ------------------------------------------------------------------ AdEMAMix through the functional form
def _ademamix(ps, gs, states, step, *, beta1=0.9, stochastic_round=False):
    torch.manual_seed(step)  # the step's stochastic-rounding keys (the default generator's)
    fast = states[0] if beta1 else None
    F.ademamix(ps, gs, fast, states[-2], states[-1], [step] * len(ps), lr=1e-2, beta1=beta1, beta2=0.999,
               beta3=0.9999, alpha=5.0, eps=1e-8, weight_decay=0.1, beta3_warmup=4, alpha_warmup=3, compile=True,
               stochastic_round=stochastic_round, grad_scale=torch.tensor(4.0))


#: name -> (param dtype, beta1, per state (format, signed, block size[, rounding])); mixed block sizes, the
#: optimizers' default stochastic rounding of signed 4bit and unsigned fp8 states, no fast EMA (beta1 = 0)
ADEMAMIX_CASES = {
    "8bit": (torch.float32, 0.9, [("8bit", True, 256), ("8bit", True, 128), ("8bit", False, 256)]),
    "4bit": (torch.float32, 0.9, [("4bit", True, 64, SR), ("4bit", True, 128, SR), ("4bit", False, 128)]),
    "fp8": (torch.float32, 0.9, [("fp8", True, 256), ("fp8", True, 128), ("fp8", False, 256, SR)]),
    "fp32": (torch.float32, 0.9, [("fp32", True, 0)] * 3),
    "8bit_beta1_0_bf16_sr": (torch.bfloat16, 0.0, [("8bit", True, 100), ("8bit", False, 96)]),
}


def _run_ademamix(case: str, c_kernel: bool, steps: int = 3):
    dtype, beta1, kinds = ADEMAMIX_CASES[case]
    gen = torch.Generator().manual_seed(0)
    shapes = PLAIN_SHAPES if kinds[0][0] in PLAIN else SHAPES
    ps = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    states = [[torch.zeros_like(p, dtype=PLAIN[k[0]]) if k[0] in PLAIN else
               qstate.zeros_like(p, k[0], signed=k[1], block_size=k[2], dtype=torch.float32,
                                 rounding=k[3] if len(k) > 3 else "nearest") for p in ps] for k in kinds]
    if c_kernel:
        _assert_c_kernel_takes("ademamix", {"maximize": False, "fast": bool(beta1)}, ps[0], [s[0] for s in states],
                               dtype == torch.bfloat16)
    with cpu_kernel_enabled(c_kernel):
        for step in range(1, steps + 1):
            _ademamix(ps, _grads(shapes, gen, dtype), states, step, beta1=beta1,
                      stochastic_round=dtype == torch.bfloat16)
    return ps, states


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in ("8bit", "fp32") else pytest.mark.exhaustive)
                                  for c in ADEMAMIX_CASES])
def test_ademamix_c_kernel_equals_inductor_kernel_bit_for_bit(case):
    ps, states = _run_ademamix(case, c_kernel=True)
    ref_ps, ref_states = _run_ademamix(case, c_kernel=False)
    for i, (p, q) in enumerate(zip(ps, ref_ps)):
        _assert_same_bits(p, q, f"{case}: param {i}")
    for k, (got, want) in enumerate(zip(states, ref_states)):
        for i, (s, t) in enumerate(zip(got, want)):
            _assert_same_bits(s, t, f"{case}: state {k} of param {i}")


def _tensor_scalars(rule: UpdateRule, group: dict, step: int, lr: float, grad_unscale: float = 1.0) -> dict:
    """The rule's scalars as the fused kernels get them: 0-dim float32 tensors."""
    floats = {"lr": lr, "grad_unscale": grad_unscale, **rule.scalars(group, step)}
    return {n: torch.tensor(floats[n], dtype=torch.float32) for n in rule.scalar_names}


def test_ademamix_c_kernel_is_its_math_on_float32_scalars():
    # plain float32 states: the C kernel gives what the rule's math gives op by op (ATen's eager kernels) on
    # whole tensors with the scalars as float32 tensors, as the fused kernels pass them: the states bit for
    # bit; the parameter within ATen's sqrt, which is not correctly rounded (the kernels' is: inductor's
    # ``std::sqrt`` / ``_mm512_sqrt_ps``)
    ps, states = _run_ademamix("fp32", c_kernel=True)
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(s, generator=gen) for s in PLAIN_SHAPES]
    ref_states = [[torch.zeros_like(p) for _ in range(3)] for p in ref]
    group = {"betas": (0.9, 0.999, 0.9999), "alpha": 5.0, "beta3_warmup": 4, "alpha_warmup": 3, "eps": 1e-8,
             "weight_decay": 0.1}
    rule = RULES["ademamix"]
    for step in range(1, 4):
        for i, g in enumerate(_grads(PLAIN_SHAPES, gen)):
            h = _tensor_scalars(rule, group, step, 1e-2, grad_unscale=0.25)
            ref[i], ref_states[i] = rule.math(ref[i], g, ref_states[i], h, {"maximize": False, "fast": True})
    for i, p in enumerate(ps):
        torch.testing.assert_close(p, ref[i], rtol=1e-6, atol=1e-8)
        for k in range(3):
            _assert_same_bits(states[k][i], ref_states[i][k], f"state {k} of param {i}")


# ------------------------------------------------------------------ Adan through the public API
ADAN_SHAPES = [(33, 71), (7, 513), (64, 64)]


def _run_adan(state_format: str, c_kernel: bool, shapes=ADAN_SHAPES, steps: int = 3, **kwargs):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = Adan(ps, lr=1e-2, weight_decay=0.02, state_format=state_format, min_quantize_numel=1, **kwargs)
    with cpu_kernel_enabled(c_kernel):
        for step in range(steps):
            for p, g in zip(ps, _grads(shapes, gen)):
                p.grad = g
            opt.step()
    if c_kernel:
        _assert_c_kernel_takes("test_adan", {"maximize": False}, ps[0],
                               [opt.state[ps[0]][s.name] for s in ADAN.states({})])
    return ps, opt


@pytest.mark.parametrize("state_format", ["8bit", pytest.param("4bit", marks=pytest.mark.exhaustive),
                                          pytest.param("fp8", marks=pytest.mark.exhaustive)])
def test_adan_c_kernel_equals_inductor_kernel_bit_for_bit(state_format):
    ps, opt = _run_adan(state_format, c_kernel=True)
    ref_ps, ref_opt = _run_adan(state_format, c_kernel=False)
    for i, (p, q) in enumerate(zip(ps, ref_ps)):
        _assert_same_bits(p.detach(), q.detach(), f"param {i}")
        for name in ("exp_avg", "exp_avg_diff", "exp_avg_sq", "prev_grad"):
            s, t = opt.state[p][name], ref_opt.state[q][name]
            assert isinstance(s, qstate.QuantizedState) and s.format == state_format
            _assert_same_bits(s, t, f"param {i} state {name}")


def test_adan_fp32_states_are_its_math_and_the_published_algorithm():
    # 2-D and 1-D, large and small: with plain states the C kernel runs at every size. Its states are the
    # rule's math op by op with float32 scalars bit for bit (no sqrt reaches them)
    shapes = [(300, 301), (33, 71), (64,)]
    ps, opt = _run_adan("fp32", c_kernel=True, shapes=shapes, steps=4)
    gen = torch.Generator().manual_seed(0)
    exact = [torch.randn(s, generator=gen) for s in shapes]
    published = [torch.nn.Parameter(p.clone()) for p in exact]
    exact_states = [[torch.zeros_like(p) for _ in range(4)] for p in exact]
    published_states: dict = {}
    group = {"betas": (0.98, 0.92, 0.99), "eps": 1e-8, "weight_decay": 0.02}
    for step in range(1, 5):
        for i, g in enumerate(_grads(shapes, gen)):
            h = _tensor_scalars(ADAN, group, step, 1e-2)
            exact[i], exact_states[i] = adan_math(exact[i], g, exact_states[i], h, {"maximize": False})
            published[i].grad = g
        with torch.no_grad():
            adan_reference_step(published, published_states, 1e-2, **group)
    names = ("exp_avg", "exp_avg_diff", "exp_avg_sq", "prev_grad")
    for i, p in enumerate(ps):
        torch.testing.assert_close(p.detach(), exact[i], rtol=1e-6, atol=1e-8)  # ATen's sqrt (the AdEMAMix test)
        for k, name in enumerate(names):
            _assert_same_bits(opt.state[p][name], exact_states[i][k], f"param {i} state {name}")
        torch.testing.assert_close(p.detach(), published[i].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")
        for name, ref_name in zip(names, ("exp_avg", "exp_avg_diff", "exp_avg_sq", "pre_grad")):
            # the authors' scalars are doubles (alpha=1 - beta2), the fused kernels' float32 tensors
            torch.testing.assert_close(opt.state[p][name], published_states[published[i]][ref_name], rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"param {i} state {name}: {m}")


# ------------------------------------------------------------------ the generator's ops against inductor's
def _op_zoo_states(flags: dict) -> tuple:
    return (StateSpec("s", True),)


def _op_zoo_math(p, g, states, h, flags):
    """Every op family the generator takes, on values that reach their special cases (NaN, infinities,
    signed zeros, both lerp formulas, both sides of each comparison)."""
    (s,) = states
    a = g * h["grad_unscale"]
    t = torch.where(a > 0, a.abs().sqrt(), -(a.abs() + 1).rsqrt()) + (a + 0.5).reciprocal() * 0.5
    t = t + torch.maximum(s, a) - torch.minimum(s, -a) + a.sign() + a.clamp(-1.0, 2.0) - a.clamp_min(0.25)
    t = t + a.clamp_max(h["w"]) + a.pow(2) * 0.1 + a.pow(3) * 0.01 + (a + 3.0).pow(-1) + a.abs().pow(0.5)
    t = t + a.square() + s.lerp(a, h["w"]) + s.lerp(a, 1 - h["w"]) + s.lerp(a, 0.3) + s.lerp(a, 0.7)
    t = torch.addcmul(t, a, s, value=0.1) + torch.addcdiv(t, a, s.abs() + 3.0, value=-0.3)
    t = t + torch.addcdiv(t, a, s.abs() + 2.0) + t.add(a, alpha=0.1).sub(s, alpha=0.2) - 1.5 * t + (1 - t)
    t = t + (t >= s).float() * 2.0 + (t != a).to(t.dtype) + a / 3.0 - (-t).neg() * 0.25
    new_s = torch.where(t < 0, t * 0.5, t / 7.0).clamp(-1e3, 1e3)
    return p - h["lr"] * t, [new_s]


OP_ZOO = register_rule(UpdateRule("test_op_zoo", _op_zoo_states, ("lr", "grad_unscale", "w"),
                                  lambda group, step: {"w": group["w"]}, _op_zoo_math))


class OpZoo(QuantizedOptimizer):
    rule = OP_ZOO

    def __init__(self, params, lr=1e-2, w=0.3, *, state_format="fp32"):
        super().__init__(params, dict(lr=lr, w=w), state_format=state_format, block_size=None,
                         min_quantize_numel=1, bf16_stochastic_round=False, compile=True, seed=0)

    def rule_flags(self, group: dict) -> dict:
        return {}


def _special_grads(shape, gen) -> torch.Tensor:
    g = torch.randn(shape, generator=gen) * 10 ** (4 * torch.rand(shape, generator=gen) - 2)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-38, 3e38, 0.5, -0.5])
    at = torch.arange(0, g.numel(), 97)[:500]
    g.view(-1)[at] = specials.repeat(50)[:len(at)]
    return g


def _same_or_both_nan(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{what}: {int((~same).sum())} elements differ, e.g. {got[~same][:4]} vs {want[~same][:4]}"


def _run_op_zoo(c_kernel: bool, w: float):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in PLAIN_SHAPES]
    opt = OpZoo(ps, w=w)
    with cpu_kernel_enabled(c_kernel):
        for _ in range(3):
            for p in ps:
                p.grad = _special_grads(p.shape, gen)
            opt.step()
    return ps, opt


@pytest.mark.exhaustive  # an inductor compile
@pytest.mark.parametrize("w", [0.3, 0.8])
def test_generated_ops_equal_inductors_on_special_values(w):
    ps, opt = _run_op_zoo(True, w)
    _assert_c_kernel_takes("test_op_zoo", {}, ps[0], [opt.state[ps[0]]["s"]])
    ref_ps, ref_opt = _run_op_zoo(False, w)
    for i, (p, q) in enumerate(zip(ps, ref_ps)):
        _same_or_both_nan(p.detach(), q.detach(), f"param {i}")
        _same_or_both_nan(opt.state[p]["s"], ref_opt.state[q]["s"], f"state of param {i}")


# ------------------------------------------------------------------ rules the generator does not take
def _exp_math(p, g, states, h, flags):
    (m,) = states
    m = m * 0.9 + g.exp()
    return p - h["lr"] * m, [m]


EXP_RULE = register_rule(UpdateRule("test_exp_rule", lambda flags: (StateSpec("m", True),), ("lr", "grad_unscale"),
                                    lambda group, step: {}, _exp_math))


class TestUnsupportedRules(expecttest.TestCase):
    def test_an_op_outside_the_set_names_the_rule_and_op_and_keeps_inductor(self):
        flags = (("maximize", False),)
        with self.assertRaises(_cpu_rule.UnsupportedRule) as caught:
            _cpu_rule.rule_source(EXP_RULE, flags)
        self.assertExpectedInline(str(caught.exception), """\
qstate CPU kernel: the update rule 'test_exp_rule' (flags {'maximize': False}) uses the op aten.exp.default, which the C generator does not take (pointwise float32 ops of qstate.optim._engine.cpu.rule_source.SUPPORTED); it runs inductor's kernel on CPU""")
        p = torch.zeros(4, 256)
        spec = KernelSpec.of("test_exp_rule", flags, p, [qstate.zeros_like(p, "8bit", signed=True,
                                                                            dtype=torch.float32)], False)
        logger = logging.getLogger("qstate")
        with self.assertLogs(logger, logging.WARNING) as logs:
            self.assertFalse(_cpu_kernel.supports(spec, torch.float32))
        self.assertIn("aten.exp.default", "\n".join(logs.output))

    def test_data_dependent_math_does_not_trace(self):
        def branching(p, g, states, h, flags):
            return (p - g if bool((g > 0).all()) else p + g), []

        rule = UpdateRule("test_branching", lambda flags: (), ("lr", "grad_unscale"), lambda group, step: {},
                          branching)
        with self.assertRaisesRegex(_cpu_rule.UnsupportedRule, "'test_branching'.*did not trace"):
            _cpu_rule.rule_source(rule, ())

    def test_other_dtypes_are_not_taken(self):
        def double(p, g, states, h, flags):
            return (p.double() - g.double() * h["lr"].double()).float(), []

        rule = UpdateRule("test_double", lambda flags: (), ("lr", "grad_unscale"), lambda group, step: {}, double)
        with self.assertRaisesRegex(_cpu_rule.UnsupportedRule, "'test_double'.*torch.float64"):
            _cpu_rule.rule_source(rule, ())


# ------------------------------------------------------------------ FSDP2: shards run the generated kernels
def _fsdp_body(rank: int, world_size: int) -> None:
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from qstate.optim import AdEMAMix

    makers = {
        "ademamix": lambda ps: AdEMAMix(ps, lr=1e-2, betas=(0.9, 0.99, 0.999), alpha=5.0, alpha_warmup=2,
                                        weight_decay=0.1, state_format="8bit", min_quantize_numel=100, seed=0),
        "test_adan": lambda ps: Adan(ps, lr=1e-2, weight_decay=0.1, state_format="8bit", min_quantize_numel=100),
    }

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(129, 65), nn.ReLU(), nn.Linear(65, 7))

    def full(x):
        return x.full_tensor() if isinstance(x, DTensor) else x

    for rule, make in makers.items():
        sharded, plain = model(), model()
        for layer in sharded:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(sharded)
        opts = [make(sharded.parameters()), make(plain.parameters())]
        for step in range(3):
            x = torch.randn(4, 129, generator=torch.Generator().manual_seed(100 + step))  # the same on every rank
            for m, opt in zip((sharded, plain), opts):
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        assert any(t.startswith(rule + "_") for t in _cpu_kernel.built_specs()), f"{rule}: the C kernel did not run"
        for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
            _assert_same_bits(full(p.detach()), q.detach(), f"{rule}: param {name}")
            for key, value in opts[1].state[q].items():
                if key != "step":
                    _assert_same_bits(full(opts[0].state[p][key]), value, f"{rule}: param {name} state {key}")


def test_fsdp2_shards_run_the_generated_kernels_as_the_unsharded_run():
    from dist_utils import run_distributed

    run_distributed(_fsdp_body, 2)

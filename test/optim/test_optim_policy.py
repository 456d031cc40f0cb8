"""The state policy is one object, :class:`qstate.optim.StatePolicy`: every optimizer takes each of its
options by keyword and no other, no constructor restates them, and Muon uses the same step as the
elementwise optimizers without an update rule of its own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import qstate
from qstate.optim import SGD, AdamW, Adam, AdEMAMix, Lion, Muon, QuantizedOptimizer, StatePolicy
from qstate.optim._policy import GROUP_OPTIONS, POLICY_OPTIONS
from qstate.optim._base import PolicyOptimizer

OPTIMIZERS = [AdamW, Adam, AdEMAMix, Lion, SGD, Muon]
OPTIONS = [f.name for f in dataclasses.fields(StatePolicy)]
#: a valid value other than the default for each option (Muon's bf16_stochastic_round stays False)
VALUES = {"state_format": "4bit", "block_size": 128, "min_quantize_numel": 16, "bf16_stochastic_round": True,
          "compile": False, "seed": 7, "state_rounding": "nearest", "skip_nonfinite": True}


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(16, 32))]


def test_the_policy_has_the_eight_options_and_the_checkpoint_options_among_them():
    assert OPTIONS == ["state_format", "block_size", "min_quantize_numel", "bf16_stochastic_round", "compile",
                       "seed", "state_rounding", "skip_nonfinite"]
    assert set(POLICY_OPTIONS) <= set(GROUP_OPTIONS) <= set(OPTIONS)
    assert set(OPTIONS) - set(GROUP_OPTIONS) == {"compile", "skip_nonfinite"}


@pytest.mark.filterwarnings("ignore:Lion. state_format='4bit' is a weak combination")
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("option", OPTIONS)
def test_every_optimizer_takes_every_policy_option_by_keyword(cls, option):
    value = False if (cls is Muon and option == "bf16_stochastic_round") else VALUES[option]
    kwargs = {option: value}
    if option == "block_size":
        kwargs["state_format"] = "4bit"
    if option == "state_rounding":
        kwargs["state_format"] = "8bit"
    opt = cls(_params(), lr=1e-3, **kwargs)
    if option in GROUP_OPTIONS:
        assert opt.param_groups[0][option] == value
        assert opt.defaults[option] == value
    else:
        assert getattr(opt, option) is value


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_an_unknown_keyword_raises_naming_the_optimizer_and_the_keyword(cls):
    with pytest.raises(TypeError) as info:
        cls(_params(), lr=1e-3, state_fromat="4bit")
    assert str(info.value) == f"{cls.__name__}.__init__() got an unexpected keyword argument 'state_fromat'"


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_no_constructor_restates_the_policy_options(cls):
    parameters = inspect.signature(cls.__init__).parameters
    assert not set(OPTIONS) & set(parameters), f"{cls.__name__}.__init__ restates policy options"
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert "StatePolicy" in cls.__doc__, f"{cls.__name__}'s docstring does not point at StatePolicy"
    for option in OPTIONS:
        assert f"{option} (" in StatePolicy.__doc__, f"StatePolicy's docstring does not document {option}"


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_the_defaults_are_the_policys(cls):
    policy = StatePolicy()
    opt = cls(_params(), lr=1e-3)
    for option in GROUP_OPTIONS:
        if option != "seed":
            assert opt.defaults[option] == getattr(policy, option), option
    assert (opt.compile, opt.skip_nonfinite) == (policy.compile, policy.skip_nonfinite)
    # Muon's seed defaults to 0 (its ranks agree without a broadcast); the others draw one privately
    assert isinstance(opt.defaults["seed"], int) and (cls is not Muon or opt.defaults["seed"] == 0)


@pytest.mark.parametrize("option, value, error, message", [
    ("compile", 1, TypeError, "compile must be a bool, got 1"),
    ("skip_nonfinite", "yes", TypeError, "skip_nonfinite must be a bool, got 'yes'"),
    ("seed", 1.5, TypeError, "seed must be an int or None, got 1.5"),
    ("bf16_stochastic_round", None, TypeError, "bf16_stochastic_round must be a bool, got None"),
    ("min_quantize_numel", -1, ValueError, "min_quantize_numel must be an int >= 0, got -1"),
    ("block_size", True, TypeError, "block_size must be an int or None, got True"),
    ("state_format", "5bit", ValueError, "unknown state_format '5bit'"),
    ("state_rounding", "up", ValueError, "state_rounding must be None or one of"),
])
def test_a_bad_value_raises_in_the_name_of_whoever_was_given_it(option, value, error, message):
    with pytest.raises(error) as info:
        StatePolicy(**{option: value})
    assert str(info.value).startswith(f"StatePolicy: {message}")
    for cls in OPTIMIZERS:
        with pytest.raises(error) as info:
            cls(_params(), lr=1e-3, **{option: value})
        assert str(info.value).startswith(f"{cls.__name__}: {message}")


def test_a_policy_object_builds_the_same_optimizer_as_its_keywords():
    policy = StatePolicy(state_format="4bit", block_size=64, min_quantize_numel=16, compile=False, seed=3)
    torch.manual_seed(0)
    params_a, params_b = _params(), None
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in params_a]
    a = AdamW(params_a, lr=1e-2, **dataclasses.asdict(policy))
    b = AdamW(params_b, lr=1e-2, state_format="4bit", block_size=64, min_quantize_numel=16, compile=False, seed=3)
    for _ in range(2):
        for pa, pb in zip(params_a, params_b):
            pa.grad = torch.randn_like(pa)
            pb.grad = pa.grad.clone()
        a.step()
        b.step()
    assert torch.equal(params_a[0], params_b[0])
    _assert_same_states(a.state[params_a[0]], b.state[params_b[0]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.seed = 4


def test_muon_is_a_policy_optimizer_without_a_rule():
    opt = Muon(_params(), lr=1e-3)
    assert isinstance(opt, PolicyOptimizer) and not isinstance(opt, QuantizedOptimizer)
    assert not hasattr(opt, "rule") and not hasattr(opt, "rule_flags")
    for cls in OPTIMIZERS:  # one step for all (torch.optim wraps it in a profiling hook per class)
        assert inspect.unwrap(cls.step) is inspect.unwrap(PolicyOptimizer.step), cls.__name__


def test_muon_rejects_bf16_stochastic_rounding_and_a_grad_scale():
    with pytest.raises(ValueError, match="Muon: bf16_stochastic_round must be False"):
        Muon(_params(), lr=1e-3, bf16_stochastic_round=True)
    params = _params()
    opt = Muon(params, lr=1e-3)
    params[0].grad = torch.randn_like(params[0])
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match=r"Muon: step\(grad_scale=...\) is not supported"):
        opt.step(grad_scale=torch.tensor(2.0))
    assert torch.equal(params[0], before) and not opt.state


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_muon_skip_nonfinite_skips_the_step_and_then_steps_as_without_the_skipped_one(fmt):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = Muon(params, lr=1e-2, state_format=fmt, min_quantize_numel=16, skip_nonfinite=True)
    ref = Muon(twins, lr=1e-2, state_format=fmt, min_quantize_numel=16)
    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]
    bad = [g.clone() for g in grads[0]]
    bad[0][3, 5] = float("inf")
    for p, g in zip(params, bad):
        p.grad = g
    opt.step()  # skipped: no state created, parameters unchanged
    assert not opt.state and all(torch.equal(p, t) for p, t in zip(params, twins))
    for step_grads in grads:
        for p, t, g in zip(params, twins, step_grads):
            p.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, t in zip(params, twins):
        assert torch.equal(p, t)
        _assert_same_states(opt.state[p], ref.state[t])


def _assert_same_states(mine: dict, reference: dict) -> None:
    assert sorted(mine) == sorted(reference)
    for name, value in reference.items():
        if isinstance(value, qstate.QuantizedState):
            assert isinstance(mine[name], qstate.QuantizedState), name
            assert torch.equal(mine[name].codes, value.codes) and torch.equal(mine[name].scale, value.scale), name
        else:
            assert torch.equal(mine[name], value), name

"""Nothing half-done: a step, ``add_param_group`` or ``load_state_dict`` that raises leaves the optimizer
as it was (parameters, states, step counts, param groups), and a retried step is exactly one step.

Every optimizer ``qstate.optim`` exports, through its public API; references are a second optimizer
over copies of the parameters that never saw the failure.
"""

from __future__ import annotations

import copy
import datetime
import math

import expecttest
import pytest
import torch
from torch import nn

import qstate
from qstate.optim import SGD, AdamW, Adam, AdEMAMix, Lion, Muon
from dist_utils import run_distributed

#: each optimizer with the options it runs with here (a fixed seed where it takes one)
_OPTIONS = {
    AdamW: dict(lr=1e-2, seed=0), Adam: dict(lr=1e-2, weight_decay=0.01, seed=0),
    SGD: dict(lr=0.1, momentum=0.9, seed=0), Lion: dict(lr=1e-3, weight_decay=0.01, seed=0),
    AdEMAMix: dict(lr=1e-2, seed=0), Muon: dict(lr=0.02, adamw_lr=1e-2),
}
OPTIMIZERS = {cls.__name__: (lambda params, cls=cls, **kw: cls(params, **{**_OPTIONS[cls], **kw})) for cls in _OPTIONS}
#: the fused kernels (compile=True) where the C kernel takes the update (no inductor compile here)
PATHS = [(name, compile) for name in OPTIMIZERS for compile in (False, True) if not (compile and name == "AdEMAMix")]
_PATH_IDS = [f"{name}-{'fused' if compile else 'eager'}" for name, compile in PATHS]


def _params() -> list[nn.Parameter]:
    """Two quantized matrices (8bit states) and a bias (float32 states)."""
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(64, 128, generator=g)), nn.Parameter(torch.randn(128, generator=g)),
            nn.Parameter(torch.randn(32, 128, generator=g))]


def _groups(params: list[nn.Parameter]) -> list[dict]:
    # the failing parameter (index 2) is in the last group: the groups before it would be written first
    return [{"params": params[:2]}, {"params": params[2:]}]


def _grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(opt, params) -> list:
    """Every parameter, state (a quantized one's codes and scales) and step count, by value (of DTensors:
    this rank's shards)."""
    out = []
    for p in params:
        out.append(("param", _local(p.detach()).clone()))
        state = opt.state.get(p, {})
        for name, v in sorted(state.items()):
            v = _local(v)
            if isinstance(v, qstate.QuantizedState):
                out.append((name, v.codes.clone(), v.scale.clone()))
            else:
                out.append((name, v.clone()))
    return out


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for x, y in zip(a, b):
        assert x[0] == y[0], (x[0], y[0])
        for u, v in zip(x[1:], y[1:]):
            assert torch.equal(u, v), x[0]


def _set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


@pytest.mark.parametrize("name, compile", PATHS, ids=_PATH_IDS)
@pytest.mark.parametrize("warm", [False, True], ids=["first_step", "warm_step"])
def test_a_step_that_raises_changes_nothing_and_a_retry_steps_once(name, compile, warm):
    params, ref_params = _params(), _params()
    opt = OPTIMIZERS[name](_groups(params), compile=compile)
    ref = OPTIMIZERS[name](_groups(ref_params), compile=compile)
    steps = 2 if warm else 1
    for step in range(steps - 1):
        for ps, o in ((params, opt), (ref_params, ref)):
            _set_grads(ps, _grads(ps, step))
            o.step()
    grads = _grads(params, steps - 1)
    _set_grads(params, grads)
    params[2].grad = grads[2].to_sparse()  # the last group's parameter: its gradient is refused
    before = _snapshot(opt, params)
    with pytest.raises(TypeError, match=r"param 2 \(shape \(32, 128\), torch.float32\): sparse gradients"):
        opt.step()
    _assert_same(_snapshot(opt, params), before)
    assert len(opt.state) == (3 if warm else 0)  # no state created by the step that raised
    if warm:  # a step count that is not a count is refused the same way
        opt.state[params[2]]["step"].fill_(math.nan)
        params[2].grad = grads[2].clone()
        with pytest.raises(ValueError, match=r"param 2 .*: its step count must be a finite non-negative integer, "
                                             r"got nan"):
            opt.step()
        opt.state[params[2]]["step"].fill_(1.0)
        _assert_same(_snapshot(opt, params), before)
    # the retry is exactly one step: the reference's
    _set_grads(params, grads)
    opt.step()
    _set_grads(ref_params, grads)
    ref.step()
    _assert_same(_snapshot(opt, params), _snapshot(ref, ref_params))
    assert all(int(opt.state[p]["step"]) == steps for p in params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_write_that_fails_part_way_keeps_the_step_counts(name):
    """A failure while writing (here: a state on the meta device, which the checks do not look at and
    the math meets when it reaches it) leaves the step counts of its group as they were; the groups written before it are
    written and counted (their parameters took the step: counting it keeps a retry from taking it twice)."""
    params = _params()
    opt = OPTIMIZERS[name](_groups(params), compile=False)
    _set_grads(params, _grads(params, 0))
    opt.step()
    state = opt.state[params[2]]
    key = next(k for k in state if k != "step")
    good = state[key]
    state[key] = torch.zeros(params[2].shape, device="meta")
    first = params[0].detach().clone()
    _set_grads(params, _grads(params, 1))
    with pytest.raises(RuntimeError):
        opt.step()
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2, 1]
    assert not torch.equal(params[0], first)  # the first group was written before the failure
    state[key] = good


# ------------------------------------------------------------------ add_param_group
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("lr", [-1.0, torch.tensor(-1.0), math.nan, torch.tensor(math.nan)],
                         ids=["float", "tensor", "float_nan", "tensor_nan"])
def test_add_param_group_with_a_bad_lr_leaves_the_groups(name, lr):
    params = _params()
    opt = OPTIMIZERS[name]([params[0]])
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError, match="invalid learning rate"):
        opt.add_param_group({"params": [params[2]], "lr": lr})
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert [g["params"] for g in opt.param_groups] == [[params[0]]]
    # the optimizer still steps, and the parameter can still be added
    opt.add_param_group({"params": [params[2]], "lr": 1e-3})
    _set_grads([params[0], params[2]], _grads([params[0], params[2]], 0))
    opt.step()
    assert all(lr >= 0 for lr in (g["lr"] for g in opt.param_groups))


# ------------------------------------------------------------------ lr
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("lr", [torch.tensor(-1.0), torch.tensor(math.nan), torch.tensor([-0.5])],
                         ids=["negative", "nan", "one_element"])
def test_a_tensor_lr_is_checked_as_torch_optim_checks_it(name, lr):
    with pytest.raises(ValueError, match="(?i)invalid learning rate"):
        torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=lr)  # torch.optim refuses it too
    with pytest.raises(ValueError, match="invalid learning rate"):
        OPTIMIZERS[name](_params(), **({"lr": lr} if name != "Muon" else {"adamw_lr": lr}))
    if name == "Muon":
        with pytest.raises(ValueError, match="invalid learning rate"):
            Muon(_params(), lr=lr)


class TestMessages(expecttest.TestCase):
    def test_lr_messages(self):
        p = [nn.Parameter(torch.zeros(2))]
        for lr in (torch.tensor(-1.0), torch.tensor(math.nan), torch.zeros(2), torch.tensor(1j), "0.1"):
            with self.assertRaises((TypeError, ValueError)) as ctx:
                AdamW(p, lr=lr)
            self.assertIsInstance(ctx.exception, TypeError if isinstance(lr, str) else ValueError)
        with self.assertRaises(ValueError) as ctx:
            AdamW(p, lr=torch.tensor(-1.0))
        self.assertExpectedInline(str(ctx.exception), """AdamW: invalid learning rate: -1.0""")
        with self.assertRaises(ValueError) as ctx:
            AdamW(p, lr=torch.zeros(2))
        self.assertExpectedInline(str(ctx.exception), """AdamW: a tensor lr must have one element, got shape (2,)""")
        with self.assertRaises(ValueError) as ctx:
            AdamW(p, lr=torch.tensor(1j))
        self.assertExpectedInline(str(ctx.exception), """AdamW: a tensor lr must be real, got dtype torch.complex64""")
        with self.assertRaises(TypeError) as ctx:
            AdamW(p, lr="0.1")
        self.assertExpectedInline(str(ctx.exception),
                                  """AdamW: lr must be a float or a one-element tensor, got str '0.1'""")

    def test_block_size_messages(self):
        with self.assertRaises(ValueError) as ctx:
            AdamW([nn.Parameter(torch.zeros(3))], block_size=2**40)
        self.assertExpectedInline(str(ctx.exception), """\
AdamW: state_format='8bit' cannot use block_size=1099511627776: format '8bit': block_size must be at most 2147483647 (the int32 range; a block larger than a row only pads it), got 1099511627776""")

    def test_load_messages(self):
        opt = _trained("AdamW")
        sd = opt.state_dict()
        sd["param_groups"][1]["seed"] = "abc"
        with self.assertRaises(TypeError) as ctx:
            opt.load_state_dict(sd)
        self.assertExpectedInline(str(ctx.exception),
                                  """AdamW: the state dict's param group 1: seed must be an int or None, got 'abc'""")
        sd = _state_dict(opt)
        sd["state"][2]["step"] = torch.tensor(-5.0)
        with self.assertRaises(ValueError) as ctx:
            opt.load_state_dict(sd)
        self.assertExpectedInline(str(ctx.exception), """\
AdamW: param 2 (shape (32, 128), torch.float32), state 'step': expected a finite non-negative integer count, got -5.0""")


# ------------------------------------------------------------------ load_state_dict
def _trained(name: str):
    params = _params()
    opt = OPTIMIZERS[name](_groups(params), compile=False)
    _set_grads(params, _grads(params, 0))
    opt.step()
    return opt


def _bad_group(option, value):
    def edit(sd):
        sd["param_groups"][-1][option] = value
    return edit


def _state_dict(opt) -> dict:
    """``opt.state_dict()`` with its own state entries (``state_dict()`` shares them with the optimizer)."""
    sd = opt.state_dict()
    sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
    return sd


def _bad_step(value):
    def edit(sd):
        sd["state"][max(sd["state"])]["step"] = torch.tensor(value)
    return edit


BAD_LOADS = {
    "seed_str": (_bad_group("seed", "abc"), TypeError, "seed must be an int"),
    "seed_float": (_bad_group("seed", 1.5), TypeError, "seed must be an int"),
    "lr_negative": (_bad_group("lr", -1.0), ValueError, "invalid learning rate"),
    "lr_tensor_negative": (_bad_group("lr", torch.tensor(-1.0)), ValueError, "invalid learning rate"),
    "lr_tensor_nan": (_bad_group("lr", torch.tensor(math.nan)), ValueError, "invalid learning rate"),
    "weight_decay": (_bad_group("weight_decay", -0.1), ValueError, "weight_decay"),
    "bf16_stochastic_round": (_bad_group("bf16_stochastic_round", "yes"), TypeError, "bf16_stochastic_round"),
    "step_nan": (_bad_step(math.nan), ValueError, "finite non-negative integer count, got nan"),
    "step_negative": (_bad_step(-5.0), ValueError, "finite non-negative integer count, got -5.0"),
    "step_fraction": (_bad_step(1.5), ValueError, "finite non-negative integer count, got 1.5"),
    "step_inf": (_bad_step(math.inf), ValueError, "finite non-negative integer count, got inf"),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_a_state_dict_with_a_bad_option_or_count_raises_at_load_and_changes_nothing(name, case):
    edit, error, message = BAD_LOADS[case]
    if case == "bf16_stochastic_round" and name == "Muon":
        pytest.skip("Muon has no bf16_stochastic_round option")
    opt = _trained(name)
    params = [p for g in opt.param_groups for p in g["params"]]
    sd = _state_dict(opt)
    edit(sd)
    before, groups = _snapshot(opt, params), copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(error, match=message):
        opt.load_state_dict(sd)
    _assert_same(_snapshot(opt, params), before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    _set_grads(params, _grads(params, 1))
    opt.step()  # and it still steps


# ------------------------------------------------------------------ block size
@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
def test_a_huge_block_size_is_refused_at_construction(fmt):
    """Also when no parameter is large enough to be quantized yet (test_state_api.py: the states')."""
    for make in OPTIMIZERS.values():
        with pytest.raises(ValueError, match=r"block_size must be at most 2147483647"):
            make([nn.Parameter(torch.zeros(3))], state_format=fmt, block_size=2**40)


# ------------------------------------------------------------------ distributed
def _failing_rank_body(rank: int, world_size: int, name: str, skip_nonfinite: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # a group that gives up after 30 s: a rank left waiting fails the test instead of hanging it
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    mesh = DeviceMesh.from_group(group, "cpu")
    params = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)) for p in _params()]
    kw = {"skip_nonfinite": True} if skip_nonfinite else {}
    opt = OPTIMIZERS[name](_groups(params), compile=False, **kw)
    grads = _grads(params, 0)

    def set_grads():
        for p, g in zip(params, grads):
            p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)

    set_grads()
    opt.step()
    grads = _grads(params, 1)
    set_grads()
    if rank == world_size - 1:  # this rank's gradient is not the parameter's kind: a plain tensor
        params[2].grad = grads[2].clone()
    before = _snapshot(opt, params)
    agrees = name == "Muon" or skip_nonfinite  # steps that communicate: every rank learns of the failure
    try:
        opt.step()
    except (TypeError, RuntimeError) as e:
        if rank == world_size - 1:
            assert "expected a DTensor gradient as the parameter, got a plain tensor" in str(e), e
        else:
            assert agrees and "failed its checks on another rank" in str(e), e
        _assert_same(_snapshot(opt, params), before)
    else:
        assert not agrees and rank != world_size - 1, "the step did not raise"
        assert all(int(opt.state[p]["step"]) == 2 for p in params)
    dist.barrier()


@pytest.mark.parametrize("name, skip_nonfinite", [("Muon", False), ("AdamW", True), ("AdamW", False)],
                         ids=["Muon", "AdamW-skip_nonfinite", "AdamW"])
def test_a_check_failing_on_one_rank(name, skip_nonfinite):
    """Where the step communicates (Muon's all-gathers, ``skip_nonfinite``'s all-reduce), every rank raises
    and none is written; otherwise (no collective in the step: nobody waits) the failing rank raises
    with nothing written and the others step. No rank hangs either way."""
    run_distributed(_failing_rank_body, 2, name, skip_nonfinite)

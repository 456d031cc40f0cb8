"""Checkpoints of qstate's optimizers: loads that raise and change nothing, and ``convert_state_dict``.

References are plain torch: ``torch.optim``'s own optimizers (``foreach=False``,
which qstate's fp32 eager path equals bit for bit) and ``qstate.quantize`` of
their float32 states.
"""

from __future__ import annotations

import copy

import expecttest
import pytest
import torch

import qstate
from qstate.distributed import state_kind
from qstate.optim import SGD, AdamW, adam_bound, convert_state_dict
from test_optim_cases import clone_params, grads, params

#: quantized (64 x 100), 1-D (fp32 at any size), small (fp32 under min_quantize_numel)
SHAPES = [(64, 100), (300,), (3, 5)]


def _err(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def _steps(opt, ps, first: int, n: int) -> None:
    for i in range(first, first + n):
        for p, g in zip(ps, grads(ps, i)):
            p.grad = g
        opt.step()


def _trained(make, n=3, shapes=SHAPES):
    ps = params(shapes)
    opt = make(ps)
    _steps(opt, ps, 0, n)
    return ps, opt


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, qstate.QuantizedState) else t.float()


def _same(a, b) -> bool:
    """Bitwise equality of two states (a quantized state's codes, scale and kind; a tensor's values)."""
    if isinstance(a, qstate.QuantizedState) or isinstance(b, qstate.QuantizedState):
        return (state_kind(a) == state_kind(b) and torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale))
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def _snapshot(opt) -> tuple:
    sd = copy.deepcopy(opt.state_dict())
    return sd["param_groups"], sd["state"]


def _assert_unchanged(opt, snapshot) -> None:
    groups, state = snapshot
    after = opt.state_dict()
    assert after["param_groups"] == groups
    assert after["state"].keys() == state.keys()
    for k, st in state.items():
        assert after["state"][k].keys() == st.keys(), k
        assert all(_same(v, after["state"][k][n]) for n, v in st.items()), k


def _eight_bit(ps):
    return AdamW(ps, lr=1e-2, state_format="8bit", min_quantize_numel=100, compile=False)


# ------------------------------------------------------------------ loading raises, changes nothing
SAVED = {
    "4bit": dict(state_format="4bit"),
    "fp32": dict(state_format="fp32"),
    "bf16": dict(state_format="bf16"),
    "block_size=64": dict(block_size=64),
    "stochastic": dict(state_rounding="stochastic"),
}


@pytest.mark.parametrize("saved", list(SAVED))
def test_loading_another_policy_raises_and_changes_nothing(saved):
    kw = {"state_format": "8bit", "min_quantize_numel": 100, **SAVED[saved]}
    _, other = _trained(lambda ps: AdamW(ps, lr=1e-2, compile=False, **kw))
    ps, opt = _trained(_eight_bit, n=2)
    before = _snapshot(opt)
    msg = _err(lambda: opt.load_state_dict(other.state_dict()))
    expected = {"4bit": "got 4bit signed block_size=128 rounding=stochastic", "fp32": "got plain torch.float32",
                "bf16": "got plain torch.bfloat16", "block_size=64": "got 8bit signed block_size=64",
                "stochastic": "got 8bit signed block_size=256 rounding=stochastic"}[saved]
    assert msg.startswith("ValueError: AdamW: param 0 (shape (64, 100), torch.float32), state 'exp_avg': expected "
                          "a 8bit signed block_size=256 state (state_format='8bit', "), msg
    assert expected in msg and "convert_state_dict" in msg, msg
    _assert_unchanged(opt, before)
    # the optimizer's options stay its own: the next step makes 8bit states as before
    _steps(opt, ps, 2, 1)
    assert state_kind(opt.state[ps[0]]["exp_avg"]) == "8bit signed block_size=256"


class TestLoadErrors(expecttest.TestCase):
    def test_policy_options_are_the_optimizers(self):
        # states of the same kinds, or none yet, still never change the optimizer's policy options
        ps, opt = _trained(_eight_bit, n=1)
        before = _snapshot(opt)
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][0]["min_quantize_numel"] = 50  # no parameter between 50 and 100 elements
        self.assertExpectedInline(_err(lambda: opt.load_state_dict(sd)), """ValueError: AdamW: param group 0, option 'min_quantize_numel': expected 100 (the optimizer's), the state dict has 50; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        fresh = AdamW(params(SHAPES), state_format="4bit")
        self.assertExpectedInline(_err(lambda: opt.load_state_dict(fresh.state_dict())), """ValueError: AdamW: param group 0, option 'state_format': expected '8bit' (the optimizer's), the state dict has '4bit'; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        _assert_unchanged(opt, before)

    def test_malformed_state_dicts_raise_before_anything_changes(self):
        ps, opt = _trained(_eight_bit, n=2)
        before = _snapshot(opt)

        def loading(edit):
            sd = copy.deepcopy(before[1]), copy.deepcopy(before[0])
            sd = {"state": sd[0], "param_groups": sd[1]}
            edit(sd)
            msg = _err(lambda: opt.load_state_dict(sd))
            _assert_unchanged(opt, before)
            return msg

        self.assertExpectedInline(loading(lambda sd: sd.pop("state")), """ValueError: AdamW: expected a state dict with keys 'param_groups' and 'state', got ['param_groups']""")
        self.assertExpectedInline(loading(lambda sd: sd.pop("param_groups")), """ValueError: AdamW: expected a state dict with keys 'param_groups' and 'state', got ['state']""")
        self.assertExpectedInline(loading(lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0]))), """ValueError: AdamW: expected 1 param groups, the state dict has 2""")
        self.assertExpectedInline(loading(lambda sd: sd["param_groups"][0]["params"].pop()), """ValueError: AdamW: param group 0: expected 3 params, the state dict has 2""")
        self.assertExpectedInline(loading(lambda sd: sd["state"][0].pop("exp_avg_sq")), """ValueError: AdamW: param 0 (shape (64, 100), torch.float32): the state dict lacks its state 'exp_avg_sq' (it has ['exp_avg', 'step']; AdamW keeps ['exp_avg', 'exp_avg_sq', 'step']); a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        self.assertExpectedInline(loading(lambda sd: sd["state"][2].pop("step")), """ValueError: AdamW: param 2 (shape (3, 5), torch.float32): the state dict lacks its state 'step' (it has ['exp_avg', 'exp_avg_sq']; AdamW keeps ['exp_avg', 'exp_avg_sq', 'step']); a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        self.assertExpectedInline(loading(lambda sd: sd["state"][1].__setitem__("exp_avg", [0.0] * 300)), """ValueError: AdamW: param 1 (shape (300,), torch.float32), state 'exp_avg': expected a tensor, got list""")
        self.assertExpectedInline(loading(lambda sd: sd["state"][1].__setitem__("step", 2)), """ValueError: AdamW: param 1 (shape (300,), torch.float32), state 'step': expected a one-element tensor, got int""")
        self.assertExpectedInline(loading(lambda sd: sd["state"].__setitem__(7, {})), """ValueError: AdamW: 'state' has an entry for 7, which no param group lists""")
        self.assertExpectedInline(loading(lambda sd: sd.__setitem__("state", [])), """ValueError: AdamW: 'state' must be a dict of each param's states, got list""")
        # amsgrad is a hyperparameter: the checkpoint's wins, and it brings its own state
        self.assertExpectedInline(loading(lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True)), """ValueError: AdamW: param 0 (shape (64, 100), torch.float32): the state dict lacks its state 'max_exp_avg_sq' (it has ['exp_avg', 'exp_avg_sq', 'step']; AdamW keeps ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step']); a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")


def test_hyperparameters_are_the_checkpoints():
    ps, opt = _trained(_eight_bit, n=1)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0].update(lr=3e-3, betas=(0.8, 0.99))
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["betas"] == (0.8, 0.99)


# ------------------------------------------------------------------ convert_state_dict
def test_torch_adamw_converted_to_8bit_continues_training():
    ps, ref = _trained(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False))
    sd = ref.state_dict()
    kept = copy.deepcopy(sd)
    qs = clone_params(ps)
    opt = AdamW(qs, lr=1.0, state_format="8bit", min_quantize_numel=100)
    converted = convert_state_dict(sd, opt)
    # the input is unchanged and shares no tensor with the result
    assert all(torch.equal(kept["state"][k][n], v) for k, st in sd["state"].items() for n, v in st.items())
    assert not {v.data_ptr() for st in sd["state"].values() for v in st.values()} & {
        v.codes.data_ptr() if isinstance(v, qstate.QuantizedState) else v.data_ptr()
        for st in converted["state"].values() for v in st.values()}
    opt.load_state_dict(converted)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["state_format"]) == (1e-2, 0.1, "8bit")
    for p, q in zip(ps, qs):
        st, want = opt.state[q], ref.state[p]
        assert float(st["step"]) == 3.0 and st["step"].dtype == torch.float32
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if p.dim() >= 2 and p.numel() >= 100:  # quantized exactly as qstate.quantize does
                q_ref = qstate.quantize(want[name], "8bit", signed=signed)
                assert _same(st[name], q_ref), name
                err = (st[name].dequantize() - want[name]).abs().max()
                assert err <= 0.02 * want[name].abs().max(), (name, err)
            else:  # 1-D and small parameters keep fp32 states
                assert st[name].dtype == torch.float32 and torch.equal(st[name], want[name])
    _steps(ref, ps, 3, 3)
    _steps(opt, qs, 3, 3)
    for p, q in zip(ps, qs):
        assert (p - q).abs().max() < 2e-3 and torch.isfinite(q).all()
    assert state_kind(opt.state[qs[0]]["exp_avg"]) == "8bit signed block_size=256"


def test_8bit_converted_to_torch_adamw_continues_as_qstate_fp32():
    ps, opt = _trained(_eight_bit)
    sd = opt.state_dict()
    a, b = clone_params(ps), clone_params(ps)
    ref = torch.optim.AdamW(a, lr=1.0, foreach=False)
    plain = convert_state_dict(sd, ref)
    assert plain["state"][0].keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for st in plain["state"].values()
               for v in st.values())
    assert torch.equal(plain["state"][0]["exp_avg"], sd["state"][0]["exp_avg"].dequantize())
    assert not {"state_format", "seed"} & plain["param_groups"][0].keys()
    # the dequantized pair (m, v) can break fp32 Adam's bound |m| <= K_t sqrt(v), which qstate's
    # update clamps to (adam_bound) and torch's does not; elsewhere the two continue bit for bit
    m, v = plain["state"][0]["exp_avg"], plain["state"][0]["exp_avg_sq"]
    consistent = m.abs() <= adam_bound(0.9, 0.999, 3) * v.sqrt()
    assert consistent.float().mean() > 0.9
    ref.load_state_dict(plain)
    fp32 = AdamW(b, lr=1.0, state_format="fp32", compile=False)
    fp32.load_state_dict(convert_state_dict(sd, fp32))
    assert ref.param_groups[0]["lr"] == fp32.param_groups[0]["lr"] == 1e-2
    _steps(ref, a, 3, 3)
    _steps(fp32, b, 3, 3)
    assert torch.equal(a[0][consistent], b[0][consistent]) and (a[0] - b[0]).abs().max() < 1e-3
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])  # fp32 states all along


def test_torch_sgd_momentum_converted_both_ways():
    kw = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2)
    ps, ref = _trained(lambda ps: torch.optim.SGD(ps, foreach=False, **kw))
    qs, q8 = clone_params(ps), clone_params(ps)
    fp32 = SGD(qs, state_format="fp32", compile=False, **kw)
    fp32.load_state_dict(convert_state_dict(ref.state_dict(), fp32))
    assert float(fp32.state[qs[0]]["step"]) == 1.0  # torch.optim.SGD counts no steps
    eight = SGD(q8, state_format="8bit", min_quantize_numel=100, **kw)
    eight.load_state_dict(convert_state_dict(ref.state_dict(), eight))
    assert _same(eight.state[q8[0]]["momentum_buffer"], qstate.quantize(ref.state[ps[0]]["momentum_buffer"], "8bit"))
    # back to torch: the buffer, no step
    back = convert_state_dict(fp32.state_dict(), ref)
    assert back["state"][0].keys() == {"momentum_buffer"}
    ref2 = torch.optim.SGD(clone_params(ps), foreach=False, **kw)
    ref2.load_state_dict(back)
    _steps(ref, ps, 3, 2)
    _steps(fp32, qs, 3, 2)  # the buffer continues (dampened), not restarted from the gradient
    _steps(eight, q8, 3, 2)
    assert all(torch.equal(x, y) for x, y in zip(ps, qs))
    assert all((x - y).abs().max() < 1e-3 for x, y in zip(ps, q8))


def test_conversions_between_formats_follow_the_policy():
    ps, opt = _trained(_eight_bit)
    sd = opt.state_dict()
    m8 = sd["state"][0]["exp_avg"].dequantize()
    v8 = sd["state"][0]["exp_avg_sq"].dequantize()
    four = AdamW(clone_params(ps), state_format="4bit", min_quantize_numel=100)
    sd4 = convert_state_dict(sd, four)
    # per state rounding as the optimizer creates them: 4bit first moments stochastic, second moments nearest
    assert _same(sd4["state"][0]["exp_avg"], qstate.quantize(m8, "4bit", rounding="stochastic"))
    assert _same(sd4["state"][0]["exp_avg_sq"], qstate.quantize(v8, "4bit", signed=False))
    assert torch.equal(sd4["state"][1]["exp_avg"], sd["state"][1]["exp_avg"])  # 1-D: fp32 in both
    four.load_state_dict(sd4)
    bf16 = AdamW(clone_params(ps), state_format="bf16", min_quantize_numel=100)
    sd16 = convert_state_dict(sd, bf16)
    assert torch.equal(sd16["state"][0]["exp_avg"], m8.bfloat16())
    assert sd16["state"][2]["exp_avg"].dtype == torch.float32  # under min_quantize_numel
    bf16.load_state_dict(sd16)
    # 8bit -> fp32 -> 8bit (block size 64, round-to-nearest) -> 8bit as saved: values within 8bit's error
    fp32 = AdamW(clone_params(ps), state_format="fp32")
    small = AdamW(clone_params(ps), state_format="8bit", block_size=64, min_quantize_numel=100)
    sd64 = convert_state_dict(convert_state_dict(sd, fp32), small)
    assert sd64["state"][0]["exp_avg"].block_size == 64
    small.load_state_dict(sd64)
    again = convert_state_dict(sd64, _eight_bit(clone_params(ps)))
    for name in ("exp_avg", "exp_avg_sq"):
        x, y = sd["state"][0][name].dequantize(), again["state"][0][name].dequantize()
        assert (x - y).abs().max() <= 0.03 * x.abs().max(), name
    assert float(again["state"][0]["step"]) == 3.0
    # another optimizer's states are not this one's
    sgd = SGD(clone_params(ps), momentum=0.9)
    assert _err(lambda: convert_state_dict(sd, sgd)) == (
        "ValueError: SGD: param 0 (shape (64, 100), torch.float32), state 'exp_avg': SGD does not keep it "
        "(it keeps ['momentum_buffer', 'step'])")


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "bf16", "fp32"])
def test_torch_adam_converted_to_every_format(fmt):
    # each state as qstate.quantize (or a cast) makes it from torch's, with the policy's signedness and
    # rounding; small parameters fp32, 1-D ones fp32 unless the format is bf16
    ps, ref = _trained(lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False))
    qs = clone_params(ps)
    opt = qstate.optim.Adam(qs, lr=1e-2, amsgrad=True, state_format=fmt, min_quantize_numel=100)
    opt.load_state_dict(convert_state_dict(ref.state_dict(), opt))
    for i, (p, q) in enumerate(zip(ps, qs)):
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
            got, want = opt.state[q][name], ref.state[p][name]
            if fmt in ("fp32", "bf16") or i > 0:
                dtype = torch.bfloat16 if fmt == "bf16" and p.numel() >= 100 else torch.float32
                assert torch.equal(got, want.to(dtype)), (i, name)
            else:
                # 4bit first moments and fp8 second moments round stochastically
                rounding = "stochastic" if (fmt, signed) in (("4bit", True), ("fp8", False)) else "nearest"
                assert _same(got, qstate.quantize(want, fmt, signed=signed, rounding=rounding)), name
    _steps(opt, qs, 3, 1)
    assert all(torch.isfinite(q).all() for q in qs)


class TestFp8CheckpointBeforeStochasticSecondMoments(expecttest.TestCase):
    def test_nearest_second_moments_are_refused_then_converted(self):
        # an fp8 checkpoint from before unsigned fp8 states rounded stochastically: its second moments are
        # nearest states. Their codes would decode the same, but they are not the kind the optimizer keeps:
        # loading raises and changes nothing; convert_state_dict re-encodes them
        def fp8(ps):
            return AdamW(ps, lr=1e-2, state_format="fp8", min_quantize_numel=100, compile=False)

        _, old = _trained(fp8)
        sd = copy.deepcopy(old.state_dict())
        v = sd["state"][0]["exp_avg_sq"]
        assert v.rounding == "stochastic"
        sd["state"][0]["exp_avg_sq"] = qstate.quantize(v.dequantize(), "fp8", signed=False)
        ps, opt = _trained(fp8, n=2)
        before = _snapshot(opt)
        self.assertExpectedInline(_err(lambda: opt.load_state_dict(copy.deepcopy(sd))), """ValueError: AdamW: param 0 (shape (64, 100), torch.float32), state 'exp_avg_sq': expected a fp8 unsigned block_size=256 rounding=stochastic state (state_format='fp8', state_rounding=None, min_quantize_numel=100), got fp8 unsigned block_size=256; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        _assert_unchanged(opt, before)
        opt.load_state_dict(convert_state_dict(sd, opt))
        got = opt.state[ps[0]]["exp_avg_sq"]
        assert got.rounding == "stochastic"
        # the same values within one code step (values on a code re-encode to it but for the last bits)
        want = sd["state"][0]["exp_avg_sq"].dequantize()
        assert torch.allclose(got.dequantize(), want, rtol=2**-3, atol=0)
        _steps(opt, ps, 2, 1)

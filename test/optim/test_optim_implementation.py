"""torch.optim's implementation arguments choose qstate's update path as they choose torch's.

``fused`` True/None: qstate's fused op and kernels; ``foreach=True``: the op over the list with the
rule's math op by op inside (its eager variant); ``fused=False`` without ``foreach``: the math op by op,
tensor by tensor. foreach and for-loop give the same bits; the fused kernels the same values up to
floating-point contraction (FMA) and reassociation (the bound ``test_compiled_quantized_matches_eager``
states, in ``test_optim.py``). References: the fused run, each other, and torch.optim.
"""

from __future__ import annotations

import itertools

import expecttest
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qstate
from qstate.optim import SGD, AdEMAMix, Adam, AdamW, Lion
from qstate.optim._engine.op import UpdateVariant  # private: the op's variant argument
from test_optim_cases import clone_params, grads, params, run_steps

#: each optimizer that takes torch's implementation arguments, with its hyperparameters and its torch
#: namesake (whose construction decides which combinations are accepted; AdamW's for the others)
OPTIMIZERS = [
    (AdamW, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW),
    (Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1), torch.optim.Adam),
    (SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1), torch.optim.SGD),
    (Lion, dict(lr=1e-3, weight_decay=0.1), torch.optim.AdamW),
    (AdEMAMix, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW),
]
_IDS = [cls.__name__ for cls, _, _ in OPTIMIZERS]
COMBINATIONS = list(itertools.product([None, False, True], repeat=2))  # (fused, foreach)
#: a quantized matrix (uneven blocks), a small matrix with plain states, a bias
SHAPES = [(64, 200), (7, 9), (200,)]


def _path(fused, foreach) -> str:
    """The documented table (``qstate/optim/_arguments.py``)."""
    if foreach:
        return "foreach"
    return "for-loop" if fused is False else "fused"


class _TopLevelOps(TorchDispatchMode):
    """Records the ops a step dispatches at the top (ops inside a kernel run without the mode)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.variants: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        if func.overloadpacket is torch.ops.qstate.fused_update:
            self.variants.append(args[4])
        return func(*args, **(kwargs or {}))


def _run(cls, kw, steps=3, shapes=SHAPES, **options):
    ps = params(shapes)
    opt = run_steps(lambda p: cls(p, **kw, **options), ps, steps, mixed=True)
    return ps, opt


def _states(opt, ps) -> list:
    return [opt.state[p][n] for p in ps for n in sorted(opt.state[p]) if n != "step"]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, qstate.QuantizedState):
        return torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    return torch.equal(a, b)


@pytest.mark.parametrize("cls, kw, namesake", OPTIMIZERS, ids=_IDS)
@pytest.mark.parametrize("fused, foreach", COMBINATIONS, ids=[f"fused={a},foreach={b}" for a, b in COMBINATIONS])
def test_every_combination_torch_accepts_is_accepted(cls, kw, namesake, fused, foreach):
    # torch.optim accepts it at construction exactly when qstate does; what torch rejects raises as torch raises
    try:
        namesake([torch.nn.Parameter(torch.zeros(2, 2))], fused=fused, foreach=foreach)
    except RuntimeError as error:
        with pytest.raises(RuntimeError) as ours:
            cls(params(SHAPES), fused=fused, foreach=foreach)
        assert str(error) in str(ours.value)
        return
    opt = cls(params(SHAPES), fused=fused, foreach=foreach, **kw)
    assert (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"]) == (fused, foreach)


# 4bit AdEMAMix's fused path is an inductor compile of its own (no C kernel): the exhaustive run's
@pytest.mark.parametrize("fmt, cls, kw, namesake", [
    pytest.param(fmt, cls, kw, namesake, id=f"{fmt}-{name}",
                 marks=pytest.mark.exhaustive if (fmt, cls) == ("4bit", AdEMAMix) else ())
    for fmt in ("8bit", "4bit", "fp32") for (cls, kw, namesake), name in zip(OPTIMIZERS, _IDS)])
def test_each_path_runs_its_implementation_and_matches_the_fused_path(fmt, cls, kw, namesake):
    kw = dict(kw, state_format=fmt, min_quantize_numel=1024, seed=0)
    runs = {}
    for fused, foreach in COMBINATIONS:
        if fused and foreach:
            continue
        ps = params(SHAPES)
        opt = cls(ps, fused=fused, foreach=foreach, **kw)
        run_steps(lambda p: opt, ps, 2, mixed=True)
        for p, g in zip(ps, grads(ps, 2, mixed=True)):
            p.grad = g
        with _TopLevelOps() as ops:  # the third step, recorded
            opt.step()
        path = _path(fused, foreach)
        eager_calls = [v for v in ops.variants if UpdateVariant.parse(v).eager]
        if path == "for-loop":  # tensor by tensor: no op call over the list
            assert ops.variants == [], ops.variants
        elif path == "foreach":  # one call over the list, every parameter's math op by op inside
            assert len(ops.variants) == len(eager_calls) == 1, ops.variants
            assert "aten.lerp" not in ops.ops and "aten.mul" not in ops.ops
        else:  # the fused kernels: the quantized states' (small plain states may run the op's eager variant)
            assert ops.variants and (fmt == "fp32" or len(ops.variants) > len(eager_calls)), ops.variants
        runs[(fused, foreach)] = ps, opt
    fused_ps, fused_opt = _run(cls, kw)  # no implementation arguments: qstate's default
    ref_ps, ref_opt = runs[(False, False)]
    for (fused, foreach), (ps, opt) in runs.items():
        states, ref_states = _states(opt, ps), _states(ref_opt, ref_ps)
        if _path(fused, foreach) == "fused":
            same = [torch.equal(a, b) for a, b in zip(ps, fused_ps)]
            assert all(same) and all(_bits_equal(a, b) for a, b in zip(states, _states(fused_opt, fused_ps)))
            # the fused kernels against the math op by op: FMA and reassociation only
            for a, b in zip(ps, ref_ps):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            for a, b in zip(states, ref_states):
                if isinstance(a, qstate.QuantizedState):
                    assert (a.codes == b.codes).float().mean() > 0.99
                else:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        else:  # foreach and for-loop: the same math op by op, the same bits
            assert all(torch.equal(a, b) for a, b in zip(ps, ref_ps)), (fused, foreach)
            assert all(_bits_equal(a, b) for a, b in zip(states, ref_states)), (fused, foreach)


@pytest.mark.parametrize("torch_kwargs", [dict(foreach=False), dict(foreach=True)], ids=str)
def test_fp32_foreach_and_for_loop_are_torchs_math_bit_for_bit(torch_kwargs):
    # with fp32 states the math op by op is torch.optim.AdamW's, op for op (test_fp32_eager_matches_torch_exactly)
    ours = {"foreach": dict(foreach=True), "for-loop": dict(fused=False, foreach=False)}
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))
    a = params(SHAPES)
    run_steps(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), a, 3, mixed=True)
    for options in ours.values():
        b = params(SHAPES)
        run_steps(lambda ps: AdamW(ps, state_format="fp32", **kw, **options), b, 3, mixed=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), options


def _torchtitan_kwargs(implementation: str) -> dict:
    """torchtitan's build_optimizers (torchtitan/components/optimizer.py), for ``implementation`` in
    ``fused``, ``foreach``, ``for-loop``."""
    return {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
            "fused": implementation == "fused", "foreach": implementation == "foreach"}


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_torchtitans_three_implementations_run(name):
    cls = {"Adam": Adam, "AdamW": AdamW}[name]
    runs = {}
    for implementation in ("fused", "foreach", "for-loop"):
        ps = params(SHAPES)
        opt = run_steps(lambda p: cls(p, state_format="4bit", seed=0, **_torchtitan_kwargs(implementation)), ps, 3)
        runs[implementation] = ps, opt
    ps, opt = runs["foreach"]
    ref, ref_opt = runs["for-loop"]
    assert all(torch.equal(a, b) for a, b in zip(ps, ref))
    assert all(_bits_equal(a, b) for a, b in zip(_states(opt, ps), _states(ref_opt, ref)))
    for a, b in zip(runs["fused"][0], ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # as torchtitan's users spell the other two
    for options in (dict(foreach=True), dict(fused=False, foreach=False)):
        qs = params(SHAPES)
        run_steps(lambda p: cls(p, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, state_format="4bit",
                                seed=0, **options), qs, 3)
        assert all(torch.equal(a, b) for a, b in zip(qs, ref))


class TestMessages(expecttest.TestCase):
    def test_fused_with_compile_false_raises(self):
        with self.assertRaises(ValueError) as info:
            AdamW(params(SHAPES), fused=True, compile=False)
        self.assertExpectedInline(str(info.exception), """\
AdamW: fused=True runs qstate's fused kernels, which compile=False turns off; pass compile=True (the default), or fused=False to run the update tensor by tensor""")
        # compile=False is the for-loop path, as fused=False; foreach=True compiles nothing
        for options in (dict(fused=False), dict(fused=None), dict(foreach=True)):
            AdamW(params(SHAPES), compile=False, **options)

    def test_fused_and_foreach_raise_as_torch(self):
        with self.assertRaises(RuntimeError) as info:
            SGD(params(SHAPES), fused=True, foreach=True)
        self.assertExpectedInline(str(info.exception), """\
SGD: `fused` and `foreach` cannot be `True` together.""")

    def test_a_loaded_group_is_checked_alike(self):
        ps = params(SHAPES)
        saved = run_steps(lambda p: AdamW(p, fused=True), ps, 1).state_dict()
        eager = AdamW(clone_params(ps), compile=False)
        with self.assertRaisesRegex(ValueError, "fused=True runs qstate's fused kernels, which compile=False"):
            eager.load_state_dict(saved)
        assert eager.state == {}


def test_where_the_math_is_exact_every_path_gives_the_same_bits():
    # plain SGD with a power-of-two lr has an exact product, so the fused kernels' float32 values are the
    # math op by op's (no FMA to differ), and bf16 stochastic rounding draws alike on every path
    # (test_bf16_stochastic_rounding_draws_the_same_on_every_path): all three paths give the same bits
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g).bfloat16() for s in [(300, 301), (64, 200), (200,)]]
    runs = {}
    for fused, foreach in COMBINATIONS:
        if fused and foreach:
            continue
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        opt = SGD(ps, lr=2.0**-10, bf16_stochastic_round=True, seed=7, fused=fused, foreach=foreach)
        run_steps(lambda p: opt, ps, 3)
        runs[(fused, foreach)] = ps
    ref = runs[(None, None)]
    assert not torch.equal(ref[0], start[0])
    for key, ps in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(ps, ref)), key

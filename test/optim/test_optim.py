"""qstate.optim: parity with torch.optim, quantized states, compile-once kernels, errors, state_dict, RNG."""

from __future__ import annotations

import copy
import io
import math

import expecttest
import pytest
import torch

import qstate
from qstate.formats import FORMATS, get_format
from qstate.optim import SGD, Adam, AdamW, Lion, adam_update_bound, cpu_kernel_enabled
from qstate.formats._codec import get_codec
from qstate.optim import functional as F
from test_optim_cases import SHAPES, clone_params, grads, params, run_steps


def _err(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def _train_pair(ref_opt, our_opt, steps=5, shapes=SHAPES, mixed=False, dtype=torch.float32):
    a = params(shapes, dtype)
    b = clone_params(a)
    run_steps(ref_opt, a, steps, mixed)
    opt = run_steps(our_opt, b, steps, mixed)
    return a, b, opt


# ------------------------------------------------------------------ parity with torch.optim (fp32 states)
TORCH_CASES = [
    (torch.optim.AdamW, AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, AdamW, dict(lr=1e-2, betas=(0.8, 0.99), amsgrad=True, maximize=True)),
    (torch.optim.Adam, Adam, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, Adam, dict(lr=1e-2, amsgrad=True, eps=1e-6)),
    (torch.optim.SGD, SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2)),
    (torch.optim.SGD, SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, maximize=True)),
    (torch.optim.SGD, SGD, dict(lr=1e-2, momentum=0.5, dampening=0.3)),
    (torch.optim.SGD, SGD, dict(lr=1e-2)),
]


@pytest.mark.parametrize("case", range(len(TORCH_CASES)))
def test_fp32_eager_matches_torch_exactly(case):
    ref_cls, cls, kw = TORCH_CASES[case]
    a, b, _ = _train_pair(lambda ps: ref_cls(ps, foreach=False, **kw),
                          lambda ps: cls(ps, state_format="fp32", compile=False, **kw), mixed=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fp32_compiled_matches_torch():
    # (300, 300): 65536 elements or more, so the compiled plain kernel runs too (smaller plain states run
    # the eager math)
    a, b, _ = _train_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                          lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1, state_format="fp32", compile=True),
                          shapes=SHAPES + [(300, 300)])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ quantized states
@pytest.mark.parametrize("fmt", sorted(FORMATS) + ["bf16"])
def test_quantized_states_close_to_fp32(fmt):
    kw = dict(lr=1e-2, weight_decay=0.1)
    a, b, opt = _train_pair(lambda ps: torch.optim.AdamW(ps, **kw),
                            lambda ps: AdamW(ps, state_format=fmt, min_quantize_numel=64, compile=False, **kw))
    for x, y, s in zip(a, b, SHAPES):
        state = opt.state[y]["exp_avg"]
        if fmt in FORMATS and qstate.wants_quantized(y, 64):  # ndim >= 2 and numel >= 64
            assert isinstance(state, qstate.QuantizedState)
        elif fmt not in FORMATS and math.prod(s) >= 64:
            assert state.dtype == torch.bfloat16
        else:
            assert type(state) is torch.Tensor and state.dtype == torch.float32
        # 5 steps of ~lr (1e-2) each: 8-bit-like states stay within half of that, 4-bit within it
        assert (x - y).abs().max() < (5e-2 if fmt == "4bit" else 2.5e-2), (fmt, s)


def test_policy_uses_numel_and_never_falls_back():
    ps = params([(64, 64), (63, 65), (10,)])
    opt = AdamW(ps, state_format="4bit", min_quantize_numel=4096, compile=False)
    for p, g in zip(ps, grads(ps, 0)):
        p.grad = g
    opt.step()
    kinds = [type(opt.state[p]["exp_avg_sq"]).__name__ for p in ps]
    assert kinds == ["QuantizedState", "Tensor", "Tensor"]
    q = opt.state[ps[0]]["exp_avg_sq"]
    assert (q.format, q.signed, q.block_size, q.dtype) == ("4bit", False, 128, torch.float32)
    assert opt.state[ps[0]]["exp_avg"].signed


@pytest.mark.parametrize("cls,kw,name", [(AdamW, dict(amsgrad=True), "exp_avg"), (Lion, {}, "exp_avg"),
                                         (SGD, dict(momentum=0.9), "momentum_buffer")])
def test_rounding_policy_stochastic_signed_4bit_states(cls, kw, name):
    def roundings(**opts):
        ps = params([(64, 64)])
        opt = run_steps(lambda p: cls(p, lr=1e-3, min_quantize_numel=0, compile=False, **kw, **opts), ps, 1)
        return {k: v.rounding for k, v in opt.state[ps[0]].items() if isinstance(v, qstate.QuantizedState)}

    unsigned = {k: "nearest" for k in ("exp_avg_sq", "max_exp_avg_sq") if cls is AdamW}
    # default: the signed state of a 4bit optimizer rounds stochastically, everything else to nearest
    assert roundings(state_format="4bit") == {name: "stochastic", **unsigned}
    assert roundings(state_format="8bit") == {name: "nearest", **unsigned}
    # fp8's unsigned states round stochastically (qstate.formats.fp8), whatever state_rounding says
    assert roundings(state_format="fp8") == {name: "nearest", **{k: "stochastic" for k in unsigned}}
    assert roundings(state_format="fp8", state_rounding="nearest") == {name: "nearest",
                                                                       **{k: "stochastic" for k in unsigned}}
    # state_rounding sets the signed states' mode; other formats' unsigned states always round to nearest
    assert roundings(state_format="4bit", state_rounding="nearest") == {name: "nearest", **unsigned}
    assert roundings(state_format="8bit", state_rounding="stochastic") == {name: "stochastic", **unsigned}


def _eager_and_compiled(fmt: str, steps: int = 3, **kw):
    a = params()
    b = clone_params(a)
    make = lambda compile: lambda ps: AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0,  # noqa: E731
                                            compile=compile, seed=0, **kw)
    return a, b, run_steps(make(False), a, steps, True), run_steps(make(True), b, steps, True)


@pytest.mark.parametrize("fmt,rounding", [("8bit", None), ("4bit", "nearest")])
def test_compiled_quantized_matches_eager(fmt, rounding):
    a, b, oe, oc = _eager_and_compiled(fmt, state_rounding=rounding)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        for name in ("exp_avg", "exp_avg_sq"):
            qe, qc = oe.state[x][name], oc.state[y][name]
            if not isinstance(qe, qstate.QuantizedState):  # 1-D parameters keep fp32 states
                torch.testing.assert_close(qc, qe, rtol=1e-4, atol=1e-6)  # FMA, reassociation
                continue
            assert qe.rounding == qc.rounding == "nearest"
            assert (qe.codes == qc.codes).float().mean() > 0.999
            torch.testing.assert_close(qc.dequantize(), qe.dequantize(), rtol=1e-2, atol=1e-6)


def test_compiled_fp8_stochastic_second_moments_match_eager():
    # fp8 second moments round stochastically, by place under the step's key on both paths: the runs part
    # only where the kernels' float order changes a value's last bits across a draw's threshold
    a, b, oe, oc = _eager_and_compiled("fp8")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        v_e, v_c = oe.state[x]["exp_avg_sq"], oc.state[y]["exp_avg_sq"]
        if isinstance(v_e, qstate.QuantizedState):
            assert v_e.rounding == v_c.rounding == "stochastic"
            assert (v_e.codes == v_c.codes).float().mean() > 0.999
            torch.testing.assert_close(v_c.dequantize(), v_e.dequantize(), rtol=2**-3, atol=0)


def test_compiled_4bit_stochastic_matches_eager():
    # Stochastic rounding draws by place under the step's key on both paths, so the runs differ only where
    # the compiled kernels' lerp (no FMA) and ATen's (FMA) part in the last bit and that difference crosses
    # a draw's threshold (as rarely as a round-to-nearest midpoint). beta1 = 0 makes the new first moment
    # the gradient itself on both paths: codes equal exactly.
    a, b, oe, oc = _eager_and_compiled("4bit", betas=(0.0, 0.999))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        m_e, m_c = oe.state[x]["exp_avg"], oc.state[y]["exp_avg"]
        if isinstance(m_e, qstate.QuantizedState):
            assert m_e.rounding == m_c.rounding == "stochastic"
            assert torch.equal(m_e.codes, m_c.codes) and torch.equal(m_e.scale, m_c.scale)
    # default betas: measured all m codes equal after 3 steps, parameters within 5e-7 (with draws from
    # each value's float bits: 74-79% of m codes equal, parameters within 1.9 lr)
    a, b, oe, oc = _eager_and_compiled("4bit")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        for name in ("exp_avg", "exp_avg_sq"):
            q_e, q_c = oe.state[x][name], oc.state[y][name]
            if isinstance(q_e, qstate.QuantizedState):
                assert (q_e.codes == q_c.codes).float().mean() > 0.999


@pytest.mark.exhaustive  # compiles a graph per kernel spec
def test_one_graph_per_kernel_kind_not_per_shape():
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    shapes = [(33, 71), (1000,), (5, 3, 7), (64, 256), (7, 513), (2, 2, 2, 300), (4096,), (1,)]
    with cpu_kernel_enabled(False):  # the inductor kernel (on CPU the C kernel takes 8bit)
        run_steps(lambda ps: AdamW(ps, lr=1e-2, state_format="8bit", min_quantize_numel=0, compile=True),
                  params(shapes), 2)
        run_steps(lambda ps: AdamW(ps, lr=1e-3, betas=(0.5, 0.9), state_format="8bit", min_quantize_numel=0),
                  params([(300, 3), (17,)]), 2)
    # one graph for the 8bit kernel spec (every ndim >= 2 shape); 1-D params keep small plain states, which
    # run eagerly (plain states below 65536 elements)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("signed", [True, False])
def test_codec_encode_equals_format_code_of(fmt, signed):
    f = get_format(fmt)
    codec = get_codec(fmt, signed, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    y = torch.randn(200_000, generator=g) * 10 ** (torch.rand(200_000, generator=g) * 9 - 8)
    y = (y / y.abs().max()) * f.max_code
    extra = [torch.tensor([0.0, -0.0, f.max_code, -f.max_code, 1e-30, -1e-30, 2.0**-24, 2.0**-30])]
    if codec.qmap is not None:
        q = codec.qmap
        mids = (q[1:] + q[:-1]) / 2
        extra += [q, mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))]
    y = torch.cat([y] + extra).clamp(-f.max_code, f.max_code)
    if not signed:
        y = y.abs()
    want = f.code_of(y, signed, f.make_qmap(signed))
    assert torch.equal(codec.encode(y, codec.tables), want)
    assert torch.equal(codec.decode(want, codec.tables), f.value_of(want, f.make_qmap(signed)))


# ------------------------------------------------------------------ quality: bounded updates
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_update_never_exceeds_fp32_adam_bound(fmt):
    lr, betas = 1e-2, (0.9, 0.999)
    worst = []

    def check(i, before, ps, opt):
        bound = adam_update_bound(*betas, i + 1)
        ratio = max(float(((p.detach() - b).abs() / lr).max()) for p, b in zip(ps, before))
        worst.append(ratio / bound)

    ps = params([(16, 512), (4096,)])
    run_steps(lambda p: AdamW(p, lr=lr, betas=betas, weight_decay=0.0, state_format=fmt, min_quantize_numel=0,
                              compile=False), ps, 30, mixed=True, on_step=check)
    assert max(worst) <= 1.0 + 1e-4, max(worst)


def test_tiny_second_moment_never_decodes_as_zero():
    # one huge and many tiny gradients per block, then zero gradients: v decays, m/sqrt(v) must stay bounded
    p = torch.nn.Parameter(torch.zeros(4, 256))
    opt = AdamW([p], lr=1.0, weight_decay=0.0, state_format="8bit", min_quantize_numel=0, compile=False)
    g = torch.full((4, 256), 1e-7)
    g[:, 0] = 1e4
    for step in range(20):
        before = p.detach().clone()
        p.grad = g if step < 3 else torch.zeros_like(g)
        opt.step()
        assert float((p.detach() - before).abs().max()) <= adam_update_bound(0.9, 0.999, step + 1) * (1 + 1e-4)
    v = opt.state[p]["exp_avg_sq"].dequantize()
    assert bool((v > 0).all())


# ------------------------------------------------------------------ lr: floats, tensors, schedulers, devices
def test_tensor_lr_and_schedulers():
    a, b = params([(64, 80)]), None
    b = clone_params(a)
    c = clone_params(a)
    ref = torch.optim.AdamW(a, lr=1e-2)
    ours = AdamW(b, lr=torch.tensor(1e-2), state_format="fp32", compile=False)
    ours_c = AdamW(c, lr=1e-2, state_format="fp32", compile=True)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4) for o in (ref, ours, ours_c)]
    for i in range(4):
        for ps, o, s in zip((a, b, c), (ref, ours, ours_c), scheds):
            for p, g in zip(ps, grads(ps, i)):
                p.grad = g
            o.step()
            s.step()
    ours.param_groups[0]["lr"] = 0.5  # a float lr replacing a tensor one
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c[0], a[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("quantized", [True, False])
def test_accelerator_lr_with_cpu_params_never_mixes_devices(quantized):
    # the FSDP2 + CPUOffloadPolicy case: a 0-dim lr tensor on the accelerator, parameters and
    # states on the CPU. FakeTensor runs the real device checks without an accelerator.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        p = torch.empty(64, 96)
        g = torch.empty(64, 96)
        m = qstate.zeros_like(p, "8bit") if quantized else torch.zeros_like(p)
        v = qstate.zeros_like(p, "8bit", signed=False) if quantized else torch.zeros_like(p)
        lr = torch.empty((), device="cuda")
        with pytest.raises(Exception, match="devices"):
            p.mul(lr)  # what a step that forgot to move lr would hit
        for fn in (F.adamw, F.adam):
            fn([p], [g], [m], [v], [1], lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        F.lion([p], [g], [m], [3], lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1)
        F.sgd([p], [g], [m], [2], lr=lr, momentum=0.9, nesterov=True, weight_decay=0.1)
        # a GradScaler's scale on the accelerator with CPU gradients (torch.amp.GradScaler("cuda") + offload)
        F.adamw([p], [g], [m], [v], [2], lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                grad_scale=torch.empty((), device="cuda"))
        assert p.device.type == "cpu" and m.device.type == "cpu"


def test_accelerator_lr_reaches_compiled_kernels_on_the_param_device():
    # the compiled path takes one scalar vector, built on the parameter's device. Private: without an
    # accelerator no public call reaches it (FakeTensor parameters take the eager path, and a fake lr with
    # real parameters would hand the C kernel a fake pointer); test/cuda_checks.py runs the real case
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qstate.optim._engine.step import _Scalars
    from qstate.optim.adam import ADAM

    with FakeTensorMode(allow_non_fake_inputs=True):
        lr = torch.empty((), device="cuda")
        s = _Scalars(ADAM, {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, lr)
        hyper = s.hyper(3, torch.device("cpu"), eager=False)
        assert hyper.device.type == "cpu" and hyper.shape == (len(ADAM.scalar_names),) and hyper.dtype == torch.float64
        assert s.eager(3, torch.device("cpu"))["lr"].device.type == "cpu"


# ------------------------------------------------------------------ bf16 stochastic rounding
def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = torch.full((200_000,), 1.0 + 2.0**-10)  # between two bf16 values (1 and 1 + 2**-7)
    torch.manual_seed(0)
    r = qstate.optim.stochastic_round_bf16(x)
    assert set(r.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(r.double().mean()) - (1.0 + 2.0**-10)) < 3e-5
    y = -torch.rand(100_000) * 100
    torch.manual_seed(1)
    assert abs(float(qstate.optim.stochastic_round_bf16(y).double().mean() - y.double().mean())) < 1e-3
    torch.manual_seed(1)
    assert torch.equal(qstate.optim.stochastic_round_bf16(y), qstate.optim.stochastic_round_bf16(y)) is False
    torch.manual_seed(1)
    a = qstate.optim.stochastic_round_bf16(y)
    torch.manual_seed(1)
    assert torch.equal(a, qstate.optim.stochastic_round_bf16(y))


def _bf16_run(steps, seed, sr, compile=False, state=None):
    # 65536 elements or more, so that compile=True runs the compiled kernel, not the eager math
    p = torch.nn.Parameter(torch.ones(512, 160, dtype=torch.bfloat16))
    opt = SGD([p], lr=2.0**-12, state_format="fp32", bf16_stochastic_round=sr, seed=seed, compile=compile)
    if state is not None:
        opt.load_state_dict(state)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p, opt


@pytest.mark.parametrize("compile", [False, True])  # op by op; the C kernel with its own draws
def test_bf16_stochastic_rounding_expected_value_and_resume(compile):
    # each step moves 1.0 by 2**-12, far below bf16's spacing (2**-7 below 2, 2**-8 below 1):
    # round-to-nearest never moves; stochastic rounding matches fp32 math on average
    p_rn, _ = _bf16_run(16, 0, sr=False, compile=compile)
    assert bool((p_rn == 1).all())
    p_sr, opt = _bf16_run(16, 0, sr=True, compile=compile)
    assert abs(float(p_sr.detach().double().mean()) - (1 - 16 * 2.0**-12)) < 2e-4
    again, _ = _bf16_run(16, 0, sr=True, compile=compile)
    assert torch.equal(again, p_sr)
    other, _ = _bf16_run(16, 1, sr=True, compile=compile)
    assert not torch.equal(other, p_sr)
    # resume: 8 steps, save, 8 more in a new optimizer == 16 in one run
    half, opt8 = _bf16_run(8, 0, sr=True, compile=compile)
    buf = io.BytesIO()
    torch.save({"p": half.detach(), "opt": opt8.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    q = torch.nn.Parameter(ckpt["p"].clone())
    opt2 = SGD([q], lr=2.0**-12, state_format="fp32", bf16_stochastic_round=True, seed=123, compile=compile)
    opt2.load_state_dict(ckpt["opt"])
    for _ in range(8):
        q.grad = torch.ones_like(q)
        opt2.step()
    assert torch.equal(q, p_sr)
    # the global stream is left alone
    torch.manual_seed(5)
    a = torch.rand(3)
    torch.manual_seed(5)
    _bf16_run(2, 0, sr=True, compile=compile)
    assert torch.equal(torch.rand(3), a)


def test_bf16_stochastic_rounding_draws_the_same_on_every_path():
    # compile=False draws as the fused kernels do (a hash of the parameter's key and each element's index),
    # so the eager math, the C kernel and the inductor kernel round a bf16 parameter alike. Plain SGD with a
    # power-of-two lr has an exact product, so every path's float32 value, hence the parameter, is the same
    # bit for bit (otherwise a path that fuses the multiply-add, as ATen does, moves a few values by one
    # float32 step, which can flip a rounding decision)
    torch.manual_seed(0)
    start = torch.randn(300, 301).bfloat16()  # 65536 elements or more: inductor's kernel runs
    grads = [torch.randn(300, 301).bfloat16() for _ in range(3)]
    runs = []
    for compile, c_kernel in [(False, True), (True, True), (True, False)]:
        p = torch.nn.Parameter(start.clone())
        opt = SGD([p], lr=2.0**-10, state_format="fp32", bf16_stochastic_round=True, seed=7, compile=compile)
        with cpu_kernel_enabled(c_kernel):
            for g in grads:
                p.grad = g.clone()
                opt.step()
        runs.append(p.detach())
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    nearest = start.float()
    for g in grads:
        nearest = (nearest - 2.0**-10 * g.float()).bfloat16().float()
    assert not torch.equal(runs[0].float(), nearest)


def test_a_compiled_caller_skips_the_optimizer_and_gets_the_same_results():
    # torch.compile over code that calls step() or the functional form: dynamo skips them
    # (torch.compiler.disable) and they run their own kernels, as when called directly. Traced instead, the
    # optimizer's Python gave 37 graphs and dozens of graph breaks for these three parameters
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(33, 71), (512,), (4, 256)]]
    ref = clone_params(ps)
    opt = AdamW(ps, lr=1e-2, state_format="8bit", min_quantize_numel=0)
    ref_opt = AdamW(ref, lr=1e-2, state_format="8bit", min_quantize_numel=0)
    step = torch.compile(opt.step)
    exp_avg, exp_avg_sq = (torch.zeros(4, 256), torch.zeros(4, 256))
    functional = torch.compile(lambda p, g, k: F.adamw([p], [g], [exp_avg], [exp_avg_sq], [k], lr=1e-2, beta1=0.9,
                                                       beta2=0.999, eps=1e-8, weight_decay=0.0))
    p, ref_p = torch.ones(4, 256), torch.ones(4, 256)
    ref_m, ref_v = torch.zeros(4, 256), torch.zeros(4, 256)
    for k in range(1, 4):
        gs = [torch.randn(p.shape) for p in ps]
        for a, b, g in zip(ps, ref, gs):
            a.grad, b.grad = g.clone(), g.clone()
        step()
        ref_opt.step()
        g = torch.randn(4, 256)
        functional(p, g, k)
        F.adamw([ref_p], [g], [ref_m], [ref_v], [k], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert all(torch.equal(a, b) for a, b in zip(ps, ref))
    assert torch.equal(p, ref_p) and torch.equal(exp_avg, ref_m) and torch.equal(exp_avg_sq, ref_v)
    assert counters["stats"]["unique_graphs"] == 0


def test_step_path_never_unwraps_dtensors():
    import pathlib

    src = pathlib.Path(qstate.optim.__file__).parent
    for f in src.glob("*.py"):
        text = f.read_text()
        for word in ("to_local(", "_local_tensor", "from_local("):
            assert word not in text, (f.name, word)


# ------------------------------------------------------------------ state_dict
@pytest.mark.parametrize("cls,kw", [(AdamW, dict(amsgrad=True)), (Lion, {}), (SGD, dict(momentum=0.9))])
def test_state_dict_round_trip(cls, kw):
    ps = params([(64, 100), (10,)], dtype=torch.bfloat16)
    opt = run_steps(lambda p: cls(p, lr=1e-2, state_format="4bit", min_quantize_numel=100, compile=False, **kw),
                    ps, 3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    ps2 = clone_params(ps)
    opt2 = cls(ps2, lr=1e-2, state_format="4bit", min_quantize_numel=100, compile=False, **kw)
    opt2.load_state_dict(loaded)
    for p, p2 in zip(ps, ps2):
        for name, value in opt.state[p].items():
            got = opt2.state[p2][name]
            assert type(got) is type(value)
            if isinstance(value, qstate.QuantizedState):
                assert (got.format, got.block_size, got.dtype) == (value.format, value.block_size, torch.float32)
                assert got.rounding == value.rounding == ("stochastic" if value.signed else "nearest")
                assert torch.equal(got.codes, value.codes) and torch.equal(got.scale, value.scale)
            else:
                assert got.dtype == value.dtype and torch.equal(got, value)
    for o, pp in ((opt, ps), (opt2, ps2)):
        for p, g in zip(pp, grads(pp, 9)):
            p.grad = g
        o.step()
    for p, p2 in zip(ps, ps2):
        assert torch.equal(p, p2)


class TestErrors(expecttest.TestCase):
    def test_bad_arguments(self):
        ps = params([(64, 64), (3, 5)])
        self.assertExpectedInline(_err(lambda: AdamW(ps, state_format="3bit")), """\
ValueError: AdamW: unknown state_format '3bit'; expected one of ['4bit', '8bit', 'bf16', 'fp32', 'fp8']""")
        self.assertExpectedInline(_err(lambda: AdamW(ps, state_format="4bit", block_size=33, min_quantize_numel=10)), """\
ValueError: AdamW: state_format='4bit' cannot use block_size=33: format '4bit': block_size must be even (two codes per byte), got 33""")
        self.assertExpectedInline(_err(lambda: Lion(ps, block_size=0, min_quantize_numel=0)), """\
ValueError: Lion: state_format='8bit' cannot use block_size=0: format '8bit': block_size must be a positive int, got 0""")
        self.assertExpectedInline(_err(lambda: SGD(ps, state_format="fp32", block_size=64)), """\
ValueError: SGD: block_size=64 has no meaning for state_format='fp32' (plain states)""")
        self.assertExpectedInline(_err(lambda: AdamW(ps, min_quantize_numel=-1)), """\
ValueError: AdamW: min_quantize_numel must be an int >= 0, got -1""")
        self.assertExpectedInline(_err(lambda: AdamW(ps, lr=-1.0)), """\
ValueError: AdamW: invalid learning rate: -1.0""")
        self.assertExpectedInline(_err(lambda: Adam(ps, betas=(0.9, 1.0))), """\
ValueError: Adam: invalid betas (0.9, 1.0): expected two values in [0, 1)""")
        self.assertExpectedInline(_err(lambda: SGD(ps, nesterov=True)), """\
ValueError: SGD: nesterov momentum requires a momentum and zero dampening""")
        self.assertExpectedInline(_err(lambda: AdamW(ps, bf16_stochastic_round=1)), """\
TypeError: AdamW: bf16_stochastic_round must be a bool, got 1""")
        self.assertExpectedInline(_err(lambda: AdamW(ps, state_rounding="up")), """\
ValueError: AdamW: state_rounding must be None or one of ['nearest', 'stochastic'], got 'up'""")
        self.assertExpectedInline(_err(lambda: Lion(ps, state_format="fp8", state_rounding="stochastic")), """\
ValueError: Lion: state_format='fp8' cannot use state_rounding='stochastic': format 'fp8': rounding='stochastic' is not implemented for signed states""")
        self.assertExpectedInline(_err(lambda: SGD(ps, state_format="bf16", state_rounding="nearest")), """\
ValueError: SGD: state_rounding='nearest' has no meaning for state_format='bf16' (plain states)""")
        ints = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
        self.assertExpectedInline(_err(lambda: AdamW(ints, min_quantize_numel=0)), """\
TypeError: AdamW: param 0 (shape (3,), torch.float64): state_format='8bit' serves float32/bfloat16/float16 parameters, got torch.float64""")

    def test_load_state_of_another_kind(self):
        ps = params([(64, 100)])
        opt = run_steps(lambda p: AdamW(p, state_format="8bit", min_quantize_numel=0, compile=False), ps, 1)
        other = AdamW(clone_params(ps), state_format="4bit", min_quantize_numel=0, compile=False)
        sd = opt.state_dict()
        # states are checked against the optimizer's policy (its state_format, not the
        # checkpoint's): another kind is an error, never converted
        self.assertExpectedInline(_err(lambda: other.load_state_dict(sd)), """ValueError: AdamW: param 0 (shape (64, 100), torch.float32), state 'exp_avg': expected a 4bit signed block_size=128 rounding=stochastic state (state_format='4bit', state_rounding=None, min_quantize_numel=0), got 8bit signed block_size=256; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")

    def test_rejected_checkpoint_leaves_the_optimizer_unchanged(self):
        ps = params([(64, 100), (33, 7)])
        opt = run_steps(lambda p: AdamW(p, state_format="8bit", min_quantize_numel=0, compile=False), ps, 2)
        before = copy.deepcopy(opt.state_dict())

        def loading(edit):
            sd = copy.deepcopy(before)
            edit(sd)
            msg = _err(lambda: opt.load_state_dict(sd))
            after = opt.state_dict()
            assert after["param_groups"] == before["param_groups"]
            for k, st in before["state"].items():
                for n, v in st.items():
                    w = after["state"][k][n]
                    same = torch.equal(v.codes, w.codes) and torch.equal(v.scale, w.scale) \
                        if isinstance(v, qstate.QuantizedState) else torch.equal(v, w)
                    assert same, (k, n)
            return msg

        def swap(key, name, value):
            return lambda sd: sd["state"][key].__setitem__(name, value)

        m = before["state"][1]["exp_avg"]
        self.assertExpectedInline(loading(swap(1, "exp_avg_sq", m)), """ValueError: AdamW: param 1 (shape (33, 7), torch.float32), state 'exp_avg_sq': expected a 8bit unsigned block_size=256 state (state_format='8bit', min_quantize_numel=0), got 8bit signed block_size=256; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        self.assertExpectedInline(loading(swap(1, "exp_avg", qstate.quantize(m.dequantize(), "8bit", block_size=64))),
                                  """ValueError: AdamW: param 1 (shape (33, 7), torch.float32), state 'exp_avg': expected a 8bit signed block_size=256 state (state_format='8bit', min_quantize_numel=0), got 8bit signed block_size=64; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        self.assertExpectedInline(loading(swap(1, "exp_avg", qstate.quantize(torch.zeros(7, 33), "8bit"))), """ValueError: AdamW: param 1 (shape (33, 7), torch.float32), state 'exp_avg': expected shape (33, 7), got (7, 33)""")
        self.assertExpectedInline(loading(swap(1, "exp_avg", qstate.quantize(m.dequantize(), "8bit", rounding="stochastic"))),
                                  """ValueError: AdamW: param 1 (shape (33, 7), torch.float32), state 'exp_avg': expected a 8bit signed block_size=256 state (state_format='8bit', state_rounding=None, min_quantize_numel=0), got 8bit signed block_size=256 rounding=stochastic; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        self.assertExpectedInline(loading(swap(0, "exp_avg", torch.zeros(64, 100))), """ValueError: AdamW: param 0 (shape (64, 100), torch.float32), state 'exp_avg': expected a 8bit signed block_size=256 state (state_format='8bit', min_quantize_numel=0), got plain torch.float32; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")

    def test_checkpoint_from_before_state_rounding(self):
        # a 4bit checkpoint saved before states had a rounding: nearest states, no state_rounding in
        # its param groups. The default (stochastic first moments) rejects it, changing nothing;
        # state_rounding='nearest' loads it and keeps that option.
        ps = params([(64, 100)])
        old = run_steps(lambda p: AdamW(p, state_format="4bit", state_rounding="nearest", min_quantize_numel=0,
                                        compile=False), ps, 2)
        sd = old.state_dict()
        for group in sd["param_groups"]:
            del group["state_rounding"]
        fresh = run_steps(lambda p: AdamW(p, state_format="4bit", min_quantize_numel=0, compile=False),
                          clone_params(ps), 1)
        before = copy.deepcopy(fresh.state_dict())
        self.assertExpectedInline(_err(lambda: fresh.load_state_dict(copy.deepcopy(sd))), """ValueError: AdamW: param 0 (shape (64, 100), torch.float32), state 'exp_avg': expected a 4bit signed block_size=128 rounding=stochastic state (state_format='4bit', state_rounding=None, min_quantize_numel=0), got 4bit signed block_size=128; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, optimizer)""")
        after = fresh.state_dict()
        assert after["param_groups"] == before["param_groups"]
        m0, m1 = before["state"][0]["exp_avg"], after["state"][0]["exp_avg"]
        assert m1.rounding == "stochastic" and torch.equal(m0.codes, m1.codes) and torch.equal(m0.scale, m1.scale)
        ps2 = clone_params(ps)
        resumed = AdamW(ps2, state_format="4bit", state_rounding="nearest", min_quantize_numel=0, compile=False)
        resumed.load_state_dict(copy.deepcopy(sd))  # a copy: state_dict() holds old's live states
        assert resumed.param_groups[0]["state_rounding"] == "nearest"
        for o, pp in ((old, ps), (resumed, ps2)):
            for p, g in zip(pp, grads(pp, 7)):
                p.grad = g
            o.step()
        assert torch.equal(ps[0], ps2[0])
        assert resumed.state[ps2[0]]["exp_avg"].rounding == "nearest"

    def test_sparse_grad(self):
        p = torch.nn.Parameter(torch.zeros(10, 3))
        opt = SGD([p], momentum=0.9, compile=False)
        p.grad = torch.zeros(10, 3).to_sparse()
        self.assertExpectedInline(_err(opt.step), """\
TypeError: SGD: param 0 (shape (10, 3), torch.float32): sparse gradients are not supported""")


def test_functional_with_own_states():
    # another library's loop: its own state tensors, quantized or plain, and int steps
    p = torch.nn.Parameter(torch.randn(32, 300))
    ref = torch.nn.Parameter(p.detach().clone())
    m, v = qstate.zeros_like(p, "8bit"), qstate.zeros_like(p, "8bit", signed=False)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2)
    for i in range(3):
        g = grads([p], i)[0]
        F.adamw([p], [g], [m], [v], [i + 1], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
        ref.grad = g
        torch_opt.step()
    assert (p - ref).abs().max() < 3e-2 and isinstance(m, qstate.QuantizedState)
    ref_m = torch_opt.state[ref]["exp_avg"]
    assert (m.dequantize() - ref_m).abs().max() <= 0.02 * ref_m.abs().max()

"""Prepared calls: a later step reuses its parameter's fused call (of the C kernel or of the compiled
inductor kernel) only while everything the call relies on is unchanged, and gives exactly what the full
path gives.

The reference is public: the same optimizer on equal parameters whose every step takes the full path,
because before each step it loads its own state dict back (new state objects of equal values, as after
loading a checkpoint: no prepared call is found for them).

Whether a step reused its calls at all (or batched them) is not observable through the public API: the
tests that check it, and the registry's lifetime and batching rules, are the last section's and reach
the private modules ``qstate.optim._prepared``, ``_fused_op`` and ``_kernels``.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import qstate

from qstate.optim import AdamW, cpu_kernel_enabled
from qstate.optim._engine import op as _fused_op, inductor as _kernels, prepared as _prepared  # private: the last section's, and :func:`reused`


def _model() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 640)), torch.nn.Parameter(torch.randn(640))]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(8, 640, generator=gen), torch.randn(640, generator=gen)]


def _full_path_step(opt) -> None:
    """``opt.step()`` on the full path: ``opt`` first loads its own state dict back (new state objects of
    equal values), so no prepared call is found."""
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.step()


def _assert_same_states(opt, ps, ref, ref_ps) -> None:
    """Equal parameters, and each state's codes and scales (or plain values), bit for bit."""
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
        for name, s in opt.state[p].items():
            r = ref.state[q][name]
            if type(s) is qstate.QuantizedState:
                assert torch.equal(s.codes, r.codes) and torch.equal(s.scale, r.scale), name
            else:
                assert torch.equal(s, r), name


class _Twin:
    """Two optimizers over equal parameters; ``ref`` steps on the full path (:func:`_full_path_step`)."""

    def __init__(self, fmt: str = "8bit"):
        self.ps, self.ref_ps = _model(), _model()
        # min_quantize_numel: the weight's states are quantized, the bias's plain (two kernel kinds)
        self.opt = AdamW(self.ps, lr=1e-2, weight_decay=0.1, state_format=fmt, min_quantize_numel=4096)
        self.ref = AdamW(self.ref_ps, lr=1e-2, weight_decay=0.1, state_format=fmt, min_quantize_numel=4096)

    def step(self, step: int, grads=None) -> None:
        grads = grads or _grads(step)
        for p, q, g in zip(self.ps, self.ref_ps, grads):
            p.grad, q.grad = g.clone(), g.clone()
        self.opt.step()
        _full_path_step(self.ref)

    def assert_equal(self) -> None:
        _assert_same_states(self.opt, self.ps, self.ref, self.ref_ps)


@pytest.fixture(params=["c", "inductor"])
def kernel(request) -> str:
    """The fused kernel the test's updates run: the C kernel, or (the C kernel off) the compiled inductor
    kernel, which runs the small plain-state bias op by op (plain states below 65536 elements)."""
    with cpu_kernel_enabled(request.param == "c"):
        yield request.param


@pytest.fixture
def reused(monkeypatch) -> list:
    """Per run of queued prepared calls (one op call queues its valid calls, then runs them in groups,
    one per kernel spec), the parameters of each group, in order (private: ``_fused_op.PendingCalls``)."""
    runs: list = []
    run = _fused_op.PendingCalls.run

    def recording(self):
        runs.append([list(ps) for *_, ps, _, _ in self.groups.values()])
        run(self)

    monkeypatch.setattr(_fused_op.PendingCalls, "run", recording)
    return runs


def _among(ps, runs) -> list:
    """The members of ``ps`` in ``runs`` (:func:`reused`), in order."""
    return [p for run in runs for group in run for p in group if any(p is q for q in ps)]


def test_later_steps_reuse_the_call_and_give_the_full_paths_results(kernel, reused):
    twin = _Twin()
    for step in range(3):
        reused.clear()
        twin.step(step)
        twin.assert_equal()
        # the first step takes the full path; then each parameter the kernel updates (the C kernel:
        # both, the inductor kernel: the weight) reuses its call, the reference never does
        ours = twin.ps if kernel == "c" else twin.ps[:1]
        assert _among(twin.ps, reused) == ([] if step == 0 else ours)
        assert _among(twin.ref_ps, reused) == []


def _new_grad_dtype(twin):
    for p in twin.ps + twin.ref_ps:
        p.grad_dtype = None  # a gradient of another dtype than the parameter's (the kernel reads either)
    return [g.bfloat16() for g in _grads(9)]


def _strided_grad(twin):  # same shape, not contiguous: the eager math runs instead of the kernel
    g = _grads(9)
    return [torch.randn(640, 8).t(), g[1]]


CHANGES = ["grad dtype", "strided grad", "param storage", "state codes", "map version", "loaded state"]


# the inductor kernel for bfloat16 gradients is a compile of its own: the exhaustive run's
@pytest.mark.parametrize("kernel, change", [
    pytest.param(k, c, marks=pytest.mark.exhaustive if (k, c) == ("inductor", "grad dtype") else ())
    for k in ("c", "inductor") for c in CHANGES], indirect=["kernel"])
def test_a_change_takes_the_full_path(change, kernel, reused):
    twin = _Twin()
    twin.step(0)
    grads = None
    weight, ref_weight = twin.ps[0], twin.ref_ps[0]
    if change == "grad dtype":
        grads = _new_grad_dtype(twin)
    elif change == "strided grad":
        grads = _strided_grad(twin)
    elif change == "param storage":
        old = weight.detach().clone()
        storage = weight.data
        weight.data = weight.data.clone()
        ref_weight.data = ref_weight.data.clone()
    elif change == "state codes":
        for opt, p in ((twin.opt, weight), (twin.ref, ref_weight)):
            opt.state[p]["exp_avg"].codes = opt.state[p]["exp_avg"].codes.clone()
    elif change == "map version":
        twin.opt.state[weight]["exp_avg_sq"].qmap.mul_(1.0)  # same values, a write
    elif change == "loaded state":
        twin.opt.load_state_dict(copy.deepcopy(twin.opt.state_dict()))  # new state objects
        twin.ref.load_state_dict(copy.deepcopy(twin.ref.state_dict()))
    reused.clear()
    twin.step(1, grads)
    twin.assert_equal()
    if change == "param storage":
        assert torch.equal(storage, old)  # the old storage is no longer the parameter's
    assert _among([weight], reused) == []  # the full path (or, for the strided gradient, the eager math)


def test_two_optimizers_over_one_parameter_keep_their_own_calls(reused):
    ps = _model()
    first, second = (AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=4096) for fmt in ("8bit", "fp8"))
    ref_ps = _model()
    ref_first, ref_second = (AdamW(ref_ps, lr=1e-2, state_format=fmt, min_quantize_numel=4096)
                             for fmt in ("8bit", "fp8"))
    for step in range(3):
        for opt, ref in ((first, ref_first), (second, ref_second)):
            for p, q, g in zip(ps, ref_ps, _grads(step)):
                p.grad, q.grad = g.clone(), g.clone()
            reused.clear()
            opt.step()
            # after the first step each optimizer reuses its own calls: neither replaces the other's
            assert _among(ps, reused) == ([] if step == 0 else ps)
            _full_path_step(ref)
            assert all(torch.equal(p, q) for p, q in zip(ps, ref_ps))
    _assert_same_states(first, ps, ref_first, ref_ps)
    _assert_same_states(second, ps, ref_second, ref_ps)


@pytest.mark.parametrize("fmt, dtype", [("8bit", torch.float32), ("4bit", torch.float32), ("fp8", torch.float32),
                                        ("fp32", torch.float32), ("8bit", torch.bfloat16), ("fp32", torch.bfloat16)])
def test_parameters_of_a_spec_run_in_one_call_with_the_same_results(fmt, dtype, reused):
    # several shapes (ragged rows, an odd 4-bit row, 3-D, 1-D plain) in one step: the C kernel's call over
    # all of a spec's parameters gives each parameter what its own call on the full path gives (bf16
    # parameters: rounded stochastically, each with its own key)
    shapes = [(8, 640), (33, 71), (7, 513), (3, 5, 300), (640,), (2, 2100)]

    def model():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]

    runs = []
    for reuse in (True, False):
        ps = model()
        opt = AdamW(ps, lr=1e-2, weight_decay=0.1, state_format=fmt, min_quantize_numel=512,
                    bf16_stochastic_round=dtype == torch.bfloat16, seed=3)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            opt.step() if reuse else _full_path_step(opt)
        runs.append((ps, opt))
        if reuse:  # at least one spec ran several parameters in one call
            assert max(len(group) for run in reused for group in run) > 1
    (ps, opt), (ref_ps, ref) = runs
    _assert_same_states(opt, ps, ref, ref_ps)


def test_a_parameter_listed_twice_is_updated_twice_in_order():
    from qstate.optim import functional as F

    results = []
    for twice in (True, False):
        p = torch.randn(8, 640, generator=torch.Generator().manual_seed(9))
        m = qstate.zeros_like(p, "8bit", signed=True, dtype=torch.float32)
        v = qstate.zeros_like(p, "8bit", signed=False, dtype=torch.float32)
        gs = [torch.randn(8, 640, generator=torch.Generator().manual_seed(k)) for k in range(3)]
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, compile=True)
        F.adamw([p], [gs[0]], [m], [v], [1], **kw)  # prepares the call
        if twice:
            F.adamw([p, p], gs[1:], [m, m], [v, v], [2, 3], **kw)
        else:
            F.adamw([p], [gs[1]], [m], [v], [2], **kw)
            F.adamw([p], [gs[2]], [m], [v], [3], **kw)
        results.append((p, m.codes, v.codes))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_grouped_call_bumps_every_parameters_version(kernel):
    # the kernel writes through raw pointers: autograd must still see each in-place update
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 1024)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = AdamW(ps, lr=1e-3, state_format="8bit")
    opt.step()  # the full path, which prepares the calls
    before = [p._version for p in ps]
    opt.step()  # one grouped call
    assert [p._version for p in ps] == [v + 1 for v in before]


@pytest.mark.exhaustive  # an inductor compile per case
@pytest.mark.parametrize("fmt, dtype", [("8bit", torch.bfloat16), ("4bit", torch.float32)])
def test_inductor_calls_over_padded_and_odd_rows_give_the_full_paths_results(fmt, dtype, reused):
    # the inductor kernel's prepared calls keep padded block-space copies (rows not a whole number of
    # blocks), refreshed before each reuse, an odd 4-bit row's last nibble, and a bf16 parameter's
    # stochastic-rounding place (a new key each step): equal to steps that rebuild every argument
    shapes = [(8, 640), (33, 71), (7, 513), (3, 5, 300), (2, 2100)]
    runs = []
    with cpu_kernel_enabled(False):
        for reuse in (True, False):
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
            opt = AdamW(ps, lr=1e-2, weight_decay=0.1, state_format=fmt, min_quantize_numel=512,
                        bf16_stochastic_round=True, seed=3)
            for step in range(3):
                gen = torch.Generator().manual_seed(step)
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                reused.clear()
                opt.step() if reuse else _full_path_step(opt)
                if reuse:  # every parameter's inductor call, from the second step on
                    assert _among(ps, reused) == ([] if step == 0 else ps)
            runs.append((ps, opt))
    (ps, opt), (ref_ps, ref) = runs
    _assert_same_states(opt, ps, ref, ref_ps)


#: quantized states' parameters: padded and odd rows, 1-D, 3-D; the last is past the CPU's batch limit
_QUANTIZED_SHAPES = [(8, 640), (33, 71), (7, 513), (3, 5, 300), (2, 2100), (1000,), (256, 256), (300, 300)]
#: plain states' (below 65536 elements they would run eagerly)
_PLAIN_SHAPES = [(256, 256), (65536,), (2, 128, 256), (300, 300)]
_BATCH_CASES = {
    # (optimizer, its arguments, parameter dtype, shapes)
    "adamw 8bit": (AdamW, dict(state_format="8bit"), torch.float32, _QUANTIZED_SHAPES),
    "adamw 4bit amsgrad": (AdamW, dict(state_format="4bit", amsgrad=True), torch.float32, _QUANTIZED_SHAPES),
    "adamw fp8 bf16 params": (AdamW, dict(state_format="fp8"), torch.bfloat16, _QUANTIZED_SHAPES),
    "lion 8bit": (qstate.optim.Lion, dict(state_format="8bit"), torch.float32, _QUANTIZED_SHAPES),
    # stochastic rounding of the parameter: each block row draws under its own parameter's key
    "adamw 8bit bf16 sr": (AdamW, dict(state_format="8bit", bf16_stochastic_round=True, seed=3), torch.bfloat16,
                           _QUANTIZED_SHAPES),
    "adamw 4bit bf16 sr": (AdamW, dict(state_format="4bit", bf16_stochastic_round=True, seed=3), torch.bfloat16,
                           _QUANTIZED_SHAPES),
    "adamw fp32 states": (AdamW, dict(state_format="fp32"), torch.float32, _PLAIN_SHAPES),
    "sgd bf16 states": (qstate.optim.SGD, dict(state_format="bf16", momentum=0.9), torch.bfloat16, _PLAIN_SHAPES),
}


@pytest.mark.exhaustive  # an inductor compile per case
@pytest.mark.parametrize("case", list(_BATCH_CASES))
def test_inductor_calls_in_batches_give_the_full_paths_results(case, monkeypatch, reused):
    # small parameters' prepared inductor calls of one spec run as one kernel call over concatenated
    # copies: the same bits as the full path (one call per parameter), and no graph of their own
    opt_cls, kwargs, dtype, shapes = _BATCH_CASES[case]
    batched = []
    run_batch = _kernels.PreparedKernelCall._run_batch

    def counting(calls, *args):
        batched.append(len(calls))
        run_batch(calls, *args)

    monkeypatch.setattr(_kernels.PreparedKernelCall, "_run_batch", staticmethod(counting))
    runs = []
    with cpu_kernel_enabled(False):
        for reuse in (False, True):  # the full path first: it compiles the kinds' graphs
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            reused.clear()
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
            # one rounding stream for both runs (seed=None would draw each its own)
            opt = opt_cls(ps, lr=1e-2, weight_decay=0.1, min_quantize_numel=512, **{"seed": 0, **kwargs})
            for step in range(3):
                gen = torch.Generator().manual_seed(step)
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                opt.step() if reuse else _full_path_step(opt)
            runs.append((ps, opt))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the batches compiled nothing
    # steps 2 and 3 reuse the calls; (300, 300) is past the CPU's batch limit and runs on its own (and
    # a small quantized parameter may run eagerly, without a call)
    per_step = [len(_among(ps, [run])) for run in reused if _among(ps, [run])]
    assert len(per_step) == 2 and per_step[0] == per_step[1] >= len(shapes) - 1
    assert batched == [per_step[0] - 1] * 2
    (ref_ps, ref), (ps, opt) = runs
    _assert_same_states(opt, ps, ref, ref_ps)


# ---------------------------------------------------------------------------------------------------------
# The registry of prepared calls, its queue and its batches: private (``_prepared``, ``_fused_op``,
# ``_kernels``). No public call observes how many calls it holds, when they leave it, or how calls are
# grouped and batched; the behaviour they serve (the full path's bits) is checked above.


def _valid_call(rule_key: tuple, p, states) -> bool:
    """Whether ``p`` (a whole parameter) has a prepared call valid for ``rule_key`` with ``states``."""
    call = _prepared.registered_call(p, states)
    return call is not None and call.valid(rule_key, p, p.grad, states, 0)


def test_calls_leave_with_their_parameters_and_states(kernel):
    gc.collect()
    _prepared.clear_prepared_calls()
    twin = _Twin()
    twin.step(0)
    opt, ps = twin.opt, twin.ps
    per_model = 2 if kernel == "c" else 1  # the inductor kernel leaves the small bias to the eager math
    assert _prepared.prepared_calls() == 2 * per_model  # the reference's too
    p = ps[0]
    rule_key = ("adam", tuple(sorted(opt.rule_flags(opt.param_groups[0]).items())), False)
    states = [opt.state[p][n] for n in ("exp_avg", "exp_avg_sq")]
    assert _valid_call(rule_key, p, states)
    with cpu_kernel_enabled(kernel != "c"):  # the other kernel would run this update: the call is not valid
        assert not _valid_call(rule_key, p, states)
    opt.state[p]["exp_avg_sq"] = states.pop().clone()  # a state other than the first dies: its call goes
    gc.collect()
    assert _prepared.prepared_calls() == 2 * per_model - 1
    opt.state.clear()  # the next step makes new states: the old calls go with the old ones
    del states
    gc.collect()
    assert _prepared.prepared_calls() == per_model
    twin.step(1)
    assert _prepared.prepared_calls() == 2 * per_model
    del twin, opt, ps, p
    gc.collect()
    assert _prepared.prepared_calls() == 0


def test_a_call_leaves_its_registry_without_the_modules_globals(monkeypatch):
    # at interpreter exit a parameter can die after the module's globals are gone: the call's weakref
    # callback uses the registry it was made with, and raises nothing
    import sys

    gc.collect()
    _prepared.clear_prepared_calls()
    registry = _prepared._PREPARED
    p = torch.nn.Parameter(torch.randn(8, 640))
    p.grad = torch.randn(8, 640)
    opt = AdamW([p], lr=1e-3, state_format="8bit")
    opt.step()
    assert len(registry) == 1
    raised: list = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    monkeypatch.setattr(_prepared, "_PREPARED", None)
    del p, opt
    gc.collect()
    assert raised == [] and len(registry) == 0


def test_a_queued_call_runs_before_an_update_of_its_parameter_outside_the_queue():
    # one op call may list a parameter twice: its second update (outside the queue, before(p)) must see
    # the first; an update of another tensor does not run the queue
    ran = []

    class Call:
        group, sr = ("c", 1), False

        @staticmethod
        def run_group(calls, ps, gs, hyper, keys):
            ran.append((len(calls), hyper))

    hyper = torch.ones(1)
    pending = _fused_op.PendingCalls(hyper)
    p, other = torch.zeros(1), torch.zeros(1)
    pending.add(Call(), p, p)
    pending.before(other)
    assert ran == []
    pending.before(p)
    assert ran == [(1, hyper)]
    pending.before(p)  # nothing queued any more
    assert ran == [(1, hyper)]


def test_clearing_the_calls_of_some_parameters_keeps_the_others():
    gc.collect()
    _prepared.clear_prepared_calls()
    twin = _Twin()
    twin.step(0)
    _prepared.clear_prepared_calls(twin.ref_ps)
    assert sorted(id(c.param()) for c in _prepared._PREPARED.values()) == sorted(id(p) for p in twin.ps)


def test_a_dropped_call_is_freed_without_a_garbage_collection():
    # an inductor-kernel call holds views of its tensors' storage: once the registry drops it (a state
    # died, or its parameter's next full path replaced it) it must go at once, not at a later collection
    import weakref

    with cpu_kernel_enabled(False):
        p = torch.nn.Parameter(torch.randn(8, 512))
        p.grad = torch.randn(8, 512)
        opt = AdamW([p], lr=1e-3, state_format="8bit")
        opt.step()
        call = weakref.ref(next(c for c in _prepared._PREPARED.values() if c.param() is p))
        assert type(call()) is _kernels.PreparedKernelCall
        gc.disable()
        try:
            opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg_sq"].clone()  # the old state dies
            assert call() is None
            opt.step()  # the full path prepares a new call; replacing it frees it too
            call = weakref.ref(next(c for c in _prepared._PREPARED.values() if c.param() is p))
            opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()
            opt.step()
            assert call() is None
        finally:
            gc.enable()


def test_batches_close_at_the_devices_limits(monkeypatch):
    # _kernels._batches: a call past the largest parameter runs alone, a batch closes before it would pass
    # the most elements; a gradient of another dtype than the first call's runs alone; a plain spec that
    # rounds the parameter stochastically (its draws are placed per call, not per block row) or a device
    # type without limits runs call by call
    from types import SimpleNamespace

    monkeypatch.setattr(_kernels, "_BATCH_LIMITS", {"cpu": (100, 250)})

    def calls(sizes, device="cpu", sr=False, unit=0, g_dtype=torch.float32):
        space = object() if unit else None  # a quantized spec's block space
        return [SimpleNamespace(rows_n=n, unit=unit, sr=sr, space=space, device=torch.device(device), g_dtype=g_dtype)
                for n in sizes]

    assert _kernels._batches(calls([50, 120, 60, 100, 90, 10, 1])) == [[1], [0, 2, 3], [4, 5, 6]]
    assert _kernels._batches(calls([50, 60], sr=True)) == [[0], [1]]
    assert _kernels._batches(calls([50, 60], device="meta")) == [[0], [1]]
    assert _kernels._batches(calls([50])) == [[0]]
    # quantized calls count their block rows' elements, padding included
    assert _kernels._batches(calls([2, 2, 2], unit=64)) == [[0], [1], [2]]
    assert _kernels._batches(calls([1, 1, 1], unit=64, sr=True)) == [[0, 1, 2]]
    mixed = calls([10, 10, 10])
    mixed[1].g_dtype = torch.bfloat16
    assert _kernels._batches(mixed) == [[1], [0, 2]]

"""Prepared calls (``qstate/optim/_prepared.py``): of the C kernel (``_cpu_kernel.PreparedCall``) and of the
compiled inductor kernel (``_kernels.PreparedKernelCall``). A later step reuses its
parameter's call only while everything the call relies on is unchanged, and gives exactly what the
full path gives (the reference: the same optimizer on equal parameters, its steps run with no
prepared call found)."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch

import qstate

from qstate.optim import AdamW, _cpu_kernel, _kernels, _prepared, cpu_kernel_enabled


def _model() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(8, 640)), torch.nn.Parameter(torch.randn(640))]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(8, 640, generator=gen), torch.randn(640, generator=gen)]


@contextlib.contextmanager
def _full_path():
    """Within the block no prepared call is found: every fused update takes the full path."""
    found = _prepared.prepared
    _prepared.prepared = lambda *args: None
    try:
        yield
    finally:
        _prepared.prepared = found


class _Twin:
    """Two optimizers over equal parameters; ``ref`` steps on the full path (:func:`_full_path`)."""

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
        with _full_path():
            self.ref.step()

    def assert_equal(self) -> None:
        for p, q in zip(self.ps, self.ref_ps):
            assert torch.equal(p, q)
            for name, s in self.opt.state[p].items():
                r = self.ref.state[q][name]
                if isinstance(s, torch.Tensor) and type(s) is not torch.Tensor:
                    assert torch.equal(s.codes, r.codes) and torch.equal(s.scale, r.scale), name
                else:
                    assert torch.equal(s, r), name


@pytest.fixture(params=["c", "inductor"])
def kernel(request) -> str:
    """The fused kernel the test's updates run: the C kernel, or (the C kernel off) the compiled inductor
    kernel, which runs the small plain-state bias op by op (``_step.SMALL_PLAIN_NUMEL``)."""
    with cpu_kernel_enabled(request.param == "c"):
        yield request.param


@pytest.fixture
def full_path_calls(monkeypatch) -> list:
    """The parameters each full-path fused call (``_cpu_kernel.run``, or a new ``PreparedKernelCall``)
    updated, in order."""
    calls: list = []
    run = _cpu_kernel.run

    def counting(spec, p, *args):
        calls.append(p)
        run(spec, p, *args)

    class Counting(_kernels.PreparedKernelCall):
        __slots__ = ()

        def __init__(self, spec, p, *args):
            calls.append(p)
            super().__init__(spec, p, *args)

    monkeypatch.setattr(_cpu_kernel, "run", counting)
    monkeypatch.setattr(_kernels, "PreparedKernelCall", Counting)
    return calls


def test_later_steps_reuse_the_call_and_give_the_full_paths_results(kernel, full_path_calls):
    twin = _Twin()
    for step in range(3):
        twin.step(step)
        twin.assert_equal()
    # the first step of each parameter the kernel updates (the C kernel: both), then only the reference's
    ours = [p for p in full_path_calls if any(p is q for q in twin.ps)]
    assert len(ours) == (2 if kernel == "c" else 1)


def _new_grad_dtype(twin):
    for p in twin.ps + twin.ref_ps:
        p.grad_dtype = None  # a gradient of another dtype than the parameter's (the kernel reads either)
    return [g.bfloat16() for g in _grads(9)]


def _strided_grad(twin):  # same shape, not contiguous: the eager math runs instead of the kernel
    g = _grads(9)
    return [torch.randn(640, 8).t(), g[1]]


@pytest.mark.parametrize("change", ["grad dtype", "strided grad", "param storage", "state codes", "map version",
                                    "loaded state"])
def test_a_change_takes_the_full_path(change, kernel, full_path_calls):
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
    full_path_calls.clear()
    twin.step(1, grads)
    twin.assert_equal()
    if change == "param storage":
        assert torch.equal(storage, old)  # the old storage is no longer the parameter's
    if change != "strided grad":  # the eager math runs that update, never the kernel
        assert any(p is weight for p in full_path_calls)


def test_two_optimizers_over_one_parameter_keep_their_own_calls():
    ps = _model()
    first, second = (AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=4096) for fmt in ("8bit", "fp8"))
    ref_ps = _model()
    ref_first, ref_second = (AdamW(ref_ps, lr=1e-2, state_format=fmt, min_quantize_numel=4096)
                             for fmt in ("8bit", "fp8"))
    for step in range(3):
        for opt, ref in ((first, ref_first), (second, ref_second)):
            for p, q, g in zip(ps, ref_ps, _grads(step)):
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            with _full_path():
                ref.step()
            assert all(torch.equal(p, q) for p, q in zip(ps, ref_ps))
    # per parameter one call of each optimizer (the references' replace each other)
    assert sum(1 for c in _prepared._PREPARED.values() if any(c.param() is p for p in ps)) == 2 * len(ps)


def test_calls_leave_with_their_parameters_and_states(kernel):
    gc.collect()
    _prepared.clear_prepared_calls()
    twin = _Twin()
    twin.step(0)
    opt, ps = twin.opt, twin.ps
    per_model = 2 if kernel == "c" else 1  # the inductor kernel leaves the small bias to the eager math
    assert _prepared.prepared_calls() == 2 * per_model  # the reference's too
    p = ps[0]
    kind = ("adam", tuple(sorted(opt._flags(opt.param_groups[0]).items())), False)
    states = [opt.state[p][n] for n in ("exp_avg", "exp_avg_sq")]
    assert _prepared.prepared(kind, p, p.grad, states) is not None
    with cpu_kernel_enabled(kernel != "c"):  # the other kernel would run this update: the call is not valid
        assert _prepared.prepared(kind, p, p.grad, states) is None
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


_RUN_PREPARED = _cpu_kernel.run_prepared


def _patch_run_prepared(monkeypatch, one_by_one: bool) -> list:
    """Patch run_prepared to record each group's size and, if ``one_by_one``, run the group's calls one
    at a time (the reference); returns the sizes."""
    sizes: list = []

    def patched(calls, params, grads, hyper, keys):
        sizes.append(len(calls))
        if one_by_one:
            for call, p, g, key in zip(calls, params, grads, keys):
                _RUN_PREPARED([call], [p], [g], hyper, [key])
        else:
            _RUN_PREPARED(calls, params, grads, hyper, keys)

    monkeypatch.setattr(_cpu_kernel, "run_prepared", patched)
    return sizes


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "fp32"])
def test_parameters_of_a_kind_run_in_one_call_with_the_same_results(fmt, monkeypatch):
    # several shapes (ragged rows, an odd 4-bit row, 3-D, 1-D plain) in one step: the kernel's call over
    # all of a kind's parameters gives each parameter what its own call gives
    shapes = [(8, 640), (33, 71), (7, 513), (3, 5, 300), (640,), (2, 2100)]

    def model():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s)) for s in shapes]

    runs, sizes = {}, {}
    for one_by_one in (False, True):
        sizes[one_by_one] = _patch_run_prepared(monkeypatch, one_by_one)
        ps = model()
        opt = AdamW(ps, lr=1e-2, weight_decay=0.1, state_format=fmt, min_quantize_numel=512)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs[one_by_one] = (ps, opt)
    (ps, opt), (ref_ps, ref) = runs[False], runs[True]
    assert max(sizes[False]) > 1  # at least one kind ran several parameters in one call
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
        for name, s in opt.state[p].items():
            r = ref.state[q][name]
            if type(s) is torch.Tensor:
                assert torch.equal(s, r), name
            else:
                assert torch.equal(s.codes, r.codes) and torch.equal(s.scale, r.scale), name


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


def test_a_queued_shard_call_runs_before_an_update_of_its_owner_outside_the_queue(monkeypatch):
    # PendingCalls.add(..., owner=X) (a DTensor parameter X queued through its shard's call): an update
    # of X outside the queue (before(X)) runs the queue first; one of another tensor does not
    ran = []
    monkeypatch.setattr(_cpu_kernel, "run_prepared", lambda calls, ps, gs, hyper, keys: ran.append(len(calls)))

    class Call:
        group, sr = ("c", 1), False

        @staticmethod
        def run_group(calls, ps, gs, hyper, keys):
            _cpu_kernel.run_prepared(calls, ps, gs, hyper, keys)

    pending = _prepared.PendingCalls()
    shard, owner, other = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    pending.add(Call(), shard, shard, 0, (1.0,), owner=owner)
    pending.before(other)
    assert ran == []
    pending.before(owner)
    assert ran == [1]
    pending.before(owner)  # nothing queued any more
    assert ran == [1]


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


@pytest.mark.parametrize("fmt, dtype", [("8bit", torch.bfloat16), ("4bit", torch.float32)])
def test_inductor_calls_over_padded_and_odd_rows_give_the_full_paths_results(fmt, dtype):
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
                with contextlib.nullcontext() if reuse else _full_path():
                    opt.step()
            if reuse:
                calls = [c for c in _prepared._PREPARED.values() if any(c.param() is p for p in ps)]
                assert len(calls) == len(ps) and all(type(c) is _kernels.PreparedKernelCall for c in calls)
            runs.append((ps, opt))
    (ps, opt), (ref_ps, ref) = runs
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
        for name, s in opt.state[p].items():
            r = ref.state[q][name]
            if name != "step":
                assert torch.equal(s.codes, r.codes) and torch.equal(s.scale, r.scale), name


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


#: quantized states' parameters: padded and odd rows, 1-D, 3-D; the last is past the CPU's batch limit
_QUANTIZED_SHAPES = [(8, 640), (33, 71), (7, 513), (3, 5, 300), (2, 2100), (1000,), (256, 256), (300, 300)]
#: plain states' (smaller ones run eagerly: _step.SMALL_PLAIN_NUMEL)
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


@pytest.mark.parametrize("case", list(_BATCH_CASES))
def test_inductor_calls_in_batches_equal_the_calls_one_by_one(case, monkeypatch):
    # small parameters' prepared inductor calls of one kind run as one kernel call over concatenated
    # copies (_kernels._run_batch): the same bits as one call per parameter, and no graph of their own
    opt_cls, kwargs, dtype, shapes = _BATCH_CASES[case]
    batched = []
    run_batch = _kernels.PreparedKernelCall._run_batch

    def counting(calls, *args):
        batched.append(len(calls))
        run_batch(calls, *args)

    monkeypatch.setattr(_kernels.PreparedKernelCall, "_run_batch", staticmethod(counting))
    runs = []
    with cpu_kernel_enabled(False):
        for limits in ({}, _kernels._BATCH_LIMITS):  # one by one first: it compiles the kinds' graphs
            monkeypatch.setattr(_kernels, "_BATCH_LIMITS", limits)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
            opt = opt_cls(ps, lr=1e-2, weight_decay=0.1, min_quantize_numel=512, **kwargs)
            for step in range(3):
                gen = torch.Generator().manual_seed(step)
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=gen).to(dtype)
                opt.step()
            runs.append((ps, opt))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the batches compiled nothing
    # steps 2 and 3 reuse the calls; (300, 300) is past the CPU's batch limit and runs on its own (and
    # a small quantized parameter may run eagerly, without a call: _step._small_eager)
    calls = [c for c in _prepared._PREPARED.values() if any(c.param() is p for p in ps)]
    assert len(calls) >= len(shapes) - 1 and batched == [len(calls) - 1] * 2
    (ref_ps, ref), (ps, opt) = runs
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
        for name, s in opt.state[p].items():
            r = ref.state[q][name]
            if type(s) is qstate.QuantizedState:
                assert torch.equal(s.codes, r.codes) and torch.equal(s.scale, r.scale), name
            else:
                assert torch.equal(s, r), name


def test_batches_close_at_the_devices_limits(monkeypatch):
    # _kernels._batches: a call past the largest parameter runs alone, a batch closes before it would pass
    # the most elements; a gradient of another dtype than the first call's runs alone; a plain kind that
    # rounds the parameter stochastically (its draws are placed per call, not per block row) or a device
    # type without limits runs call by call
    from types import SimpleNamespace

    monkeypatch.setattr(_kernels, "_BATCH_LIMITS", {"cpu": (100, 250)})

    def calls(sizes, device="cpu", sr=False, unit=0, g_dtype=torch.float32):
        space = object() if unit else None  # a quantized kind's block space
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

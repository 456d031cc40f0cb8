"""Quantized states inside DTensor, simulated ranks (fake process group + LocalTensorMode).

Property tests over shapes (uneven first dims included), formats, meshes and
placements: from_local / full_tensor / redistribute, and ops the optimizers
call, all compared with the unsharded quantized tensor.
"""

from __future__ import annotations


import expecttest
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate

local_tensor = pytest.importorskip("torch.distributed._local_tensor")
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=WORLD)
    assert dist.get_world_size() == WORLD
    yield


def _ranks(t: torch.Tensor) -> list[torch.Tensor]:
    """Per-rank values of a LocalTensor (or the tensor itself)."""
    if isinstance(t, local_tensor.LocalTensor):
        return [t._local_tensors[r] for r in sorted(t._local_tensors)]
    return [t]


def _meshes():
    return st.sampled_from([(4,), (2, 2)])


@st.composite
def placements_for(draw, ndim_mesh: int):
    return [draw(st.sampled_from([Shard(0), Replicate()])) for _ in range(ndim_mesh)]


def _rounding(draw, fmt: str, signed: bool) -> str:
    """A rounding mode ``fmt`` implements for ``signed`` states (stochastic where it can be)."""
    ok = [r for r in qstate.formats.ROUNDINGS if qstate.formats.get_format(fmt).supports_rounding(r, signed)]
    return draw(st.sampled_from(ok), label="rounding")


@settings(max_examples=40)
@given(rows=st.integers(1, 23), cols=st.integers(1, 300), trailing=st.sampled_from([(), (3,)]),
       fmt=st.sampled_from(sorted(qstate.formats.FORMATS)), signed=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), mesh_shape=_meshes(), data=st.data())
def test_full_tensor_and_redistribute_equal_unsharded(rows, cols, trailing, fmt, signed, dtype, mesh_shape, data):
    shape = (rows, cols, *trailing)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(rows * 1000 + cols)).to(dtype)
    x = x if signed else x.abs()
    rounding = _rounding(data.draw, fmt, signed)
    ref = qstate.quantize(x, fmt, signed=signed, rounding=rounding)
    with local_tensor.LocalTensorMode(WORLD) as mode:
        mesh = init_device_mesh("cpu", mesh_shape)
        placements = data.draw(placements_for(len(mesh_shape)))
        d = distribute_tensor(x, mesh, placements)
        # stochastic rounding too: each shard's codes are the unsharded tensor's rows
        qd = qstate.quantize(d, fmt, signed=signed, rounding=rounding)
        assert isinstance(qd, DTensor) and qd.dtype == dtype and tuple(qd.shape) == shape
        full = qd.full_tensor()
        back = qd.redistribute(mesh, [Replicate()] * mesh.ndim).redistribute(mesh, placements)
        z = qstate.zeros_like(d, fmt, signed=signed, rounding=rounding)
        z.copy_(qd)
        with mode.disable():
            for f in _ranks(full):
                assert isinstance(f, qstate.QuantizedState) and f.dtype == dtype and f.block_size == ref.block_size
                assert f.rounding == rounding
                assert torch.equal(f.codes, ref.codes) and torch.equal(f.scale, ref.scale)
            for a, b, c in zip(_ranks(back.to_local()), _ranks(qd.to_local()), _ranks(z.to_local())):
                assert a.rounding == b.rounding == c.rounding == rounding
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
                assert torch.equal(c.codes, b.codes) and torch.equal(c.scale, b.scale)


@settings(max_examples=25)
@given(rows=st.integers(1, 23), cols=st.integers(1, 200), fmt=st.sampled_from(sorted(qstate.formats.FORMATS)),
       mesh_shape=_meshes(), data=st.data())
def test_optimizer_ops_on_dtensor_states_match_unsharded(rows, cols, fmt, mesh_shape, data):
    g = torch.Generator().manual_seed(rows + 7 * cols)
    m0, grad = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
    rounding = _rounding(data.draw, fmt, True)
    ref = qstate.quantize(m0, fmt, rounding=rounding)
    ref_new = ref.lerp(grad, 0.1)
    ref.copy_(ref_new)
    with local_tensor.LocalTensorMode(WORLD) as mode:
        mesh = init_device_mesh("cpu", mesh_shape)
        placements = data.draw(placements_for(len(mesh_shape)))
        qd = qstate.quantize(distribute_tensor(m0, mesh, placements), fmt, rounding=rounding)
        gd = distribute_tensor(grad, mesh, placements)
        with CommDebugMode() as comm:
            new = qd.lerp(gd, 0.1)  # plain DTensor result
            qd.copy_(new)  # requantized in place, shard by shard
        assert comm.get_total_counts() == 0
        full = qd.full_tensor()
        new_full = new.full_tensor()
        with mode.disable():
            for f, n in zip(_ranks(full), _ranks(new_full)):
                assert torch.equal(n, ref_new)
                assert f.rounding == rounding and torch.equal(f.codes, ref.codes)
                assert torch.equal(f.dequantize(), ref.dequantize())



@settings(max_examples=25)
@given(rows=st.integers(1, 23), cols=st.integers(1, 200), fmt=st.sampled_from(sorted(qstate.formats.FORMATS)),
       mesh_shape=_meshes(), data=st.data())
def test_copy_with_draws_on_dtensor_states_matches_unsharded(rows, cols, fmt, mesh_shape, data):
    # qstate::copy_with_draws_ (the optimizers' op-by-op state write) shard by shard, no collectives: the
    # same codes as the unsharded write, each element rounding by its own draw; by-value (copy_) and by-position
    # stochastic writes differ
    g = torch.Generator().manual_seed(rows + 7 * cols)
    x = torch.randn(rows, cols, generator=g)
    draws = torch.randint(0, 2**32, (rows, cols), generator=g)
    rounding = _rounding(data.draw, fmt, True)
    ref = qstate.zeros_like(x, fmt, rounding=rounding, dtype=torch.float32)
    torch.ops.qstate.copy_with_draws_(ref, x, draws)
    by_value = qstate.quantize(x, fmt, rounding=rounding)
    if rounding == "nearest":
        assert torch.equal(ref.codes, by_value.codes)
    with local_tensor.LocalTensorMode(WORLD) as mode:
        mesh = init_device_mesh("cpu", mesh_shape)
        placements = data.draw(placements_for(len(mesh_shape)))
        xd, drawsd = distribute_tensor(x, mesh, placements), distribute_tensor(draws, mesh, placements)
        qd = qstate.zeros_like(xd, fmt, rounding=rounding)
        with CommDebugMode() as comm:
            torch.ops.qstate.copy_with_draws_(qd, xd, drawsd)
        assert comm.get_total_counts() == 0
        full = qd.full_tensor()
        with mode.disable():
            for f in _ranks(full):
                assert f.rounding == rounding
                assert torch.equal(f.codes, ref.codes) and torch.equal(f.scale, ref.scale)


def test_copy_with_draws_checks_the_draws_shape_before_writing():
    q = qstate.zeros_like(torch.empty(4, 64), "4bit", rounding="stochastic", dtype=torch.float32)
    before = q.codes.clone()
    with pytest.raises(ValueError, match=r"copy_with_draws_: expected draws of shape \(4, 64\), got \(4, 32\)"):
        torch.ops.qstate.copy_with_draws_(q, torch.randn(4, 64), torch.zeros(4, 32, dtype=torch.int64))
    assert torch.equal(q.codes, before)


class TestDTensorStatePins(expecttest.TestCase):
    def test_full_tensor_collectives_8bit_two_ranks(self):
        with local_tensor.LocalTensorMode(WORLD):
            two_ranks = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]
            assert two_ranks.size() == 2
            qd = qstate.zeros_like(distribute_tensor(torch.zeros(65, 129), two_ranks, [Shard(0)]), "8bit")
            with CommDebugMode() as comm:
                qd.full_tensor()
            self.assertExpectedInline(
                str({str(k): v for k, v in comm.get_comm_counts().items()}),
                """{'c10d_functional.all_gather_into_tensor': 1}""")

    def test_rejected_placements(self):
        with local_tensor.LocalTensorMode(WORLD):
            mesh = init_device_mesh("cpu", (4,))
            d = distribute_tensor(torch.zeros(8, 16), mesh, [Shard(1)])
            with self.assertRaises(NotImplementedError) as info:
                qstate.zeros_like(d, "8bit")
            self.assertExpectedInline(str(info.exception), """zeros_like: a quantized DTensor state must be Replicate() or Shard(0) on every mesh dim, got placements (Shard(dim=1),) for shape (8, 16)""")
            p = DTensor.from_local(torch.zeros(8, 16), mesh, [Partial()])
            with self.assertRaises(NotImplementedError):
                qstate.quantize(p, "4bit")

    def test_dtensor_entry_points_reject_a_plain_tensor(self):
        for fn in (qstate.distributed.quantize_dtensor, qstate.distributed.zeros_like_dtensor):
            with self.assertRaises(TypeError) as info:
                fn(torch.zeros(8, 16), "8bit")
            self.assertExpectedInline(str(info.exception).split(":")[1], """ expected a DTensor, got Tensor""")
            assert str(info.exception).startswith(fn.__name__)

    def test_fused_update_rejects_layouts_it_cannot_run_shard_by_shard(self):
        fused_update = torch.ops.qstate.fused_update.default
        from qstate.dtensor_rules import flat_starts

        def error(fn) -> str:
            # DTensor raises a strategy's error as a RuntimeError from it: pin the strategy's
            with self.assertRaises(Exception) as info:
                fn()
            cause = info.exception.__cause__ or info.exception
            return f"{type(cause).__name__}: {cause}"

        def update(param, grad, states, hyper=None, **kwargs):
            hyper = DTensor.from_local(torch.zeros(9), mesh, [Replicate()]) if hyper is None else hyper
            return error(lambda: fused_update([param], [grad], states, hyper, "unused", **kwargs))

        with local_tensor.LocalTensorMode(WORLD):
            mesh = init_device_mesh("cpu", (4,))
            p = distribute_tensor(torch.zeros(8, 16), mesh, [Shard(0)])
            g = distribute_tensor(torch.zeros(8, 16), mesh, [Shard(0)])
            r = distribute_tensor(torch.zeros(8, 16), mesh, [Replicate()])
            partial = DTensor.from_local(torch.zeros(8, 16), mesh, [Partial()])
            self.assertExpectedInline(update(p, g, [r]), """LayoutMismatch: qstate::fused_update on DTensors: params[0]: states[0] must match param (shape (8, 16), placements (Shard(dim=0),) on DeviceMesh((4,), 'cpu', stride=(1,))), got shape (8, 16), placements (Replicate(),) on DeviceMesh((4,), 'cpu', stride=(1,))""")
            self.assertExpectedInline(update(p, torch.zeros(8, 16), [g]), """RuntimeError: qstate.fused_update.default got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling distributed operators!""")
            self.assertExpectedInline(update(partial, partial, []), """LayoutMismatch: qstate::fused_update on DTensors: params[0]: Partial placements (Partial(sum),) are not shards of the update; redistribute first""")
            self.assertExpectedInline(update(p, g, [g], hyper=distribute_tensor(torch.zeros(12), mesh, [Shard(0)])), """ValueError: qstate::fused_update on DTensors: hyper must be replicated, got (Shard(dim=0),)""")
            # stochastic-rounding keys: each shard must be one range of the flat parameter (its draws' places)
            cols = distribute_tensor(torch.zeros(8, 16), mesh, [Shard(1)])
            self.assertExpectedInline(error(lambda: flat_starts(cols)), """LayoutMismatch: placements (Shard(dim=1),) do not keep each shard one range of the flat parameter (Shard(0) and Replicate do)""")
            replicated_start = DTensor.from_local(torch.zeros(1, dtype=torch.int64), mesh, [Replicate()])
            self.assertExpectedInline(update(p, g, [g], sr_keys=[1], starts=[replicated_start]), """LayoutMismatch: qstate::fused_update on DTensors: starts[0] must have params[0]'s placements (Shard(dim=0),) on DeviceMesh((4,), 'cpu', stride=(1,)), got (Replicate(),) on DeviceMesh((4,), 'cpu', stride=(1,))""")
            self.assertExpectedInline(update(cols, cols, [], sr_keys=[1], starts=[replicated_start]), """LayoutMismatch: qstate::fused_update on DTensors with starts: params[0]: placements (Shard(dim=1),) do not keep each shard one range of the flat parameter (Shard(0) and Replicate do)""")
            # the lists must pair up (DTensors or not)
            self.assertExpectedInline(error(lambda: fused_update([p, p], [g], [r], DTensor.from_local(torch.zeros(9), mesh, [Replicate()]), "unused")), """ValueError: qstate::fused_update: expected one grad per param and the same number of states per param, got 2 params, 1 grads, 1 states""")


def test_policy_uses_global_numel_same_type_on_every_rank():
    with local_tensor.LocalTensorMode(WORLD) as mode:
        mesh = init_device_mesh("cpu", (4,))
        # 65 x 64 = 4160 >= 4096 globally, but every local shard is < 4096
        p = distribute_tensor(torch.zeros(65, 64), mesh, [Shard(0)])
        s = qstate.state_like(p, "8bit")
        bias = qstate.state_like(distribute_tensor(torch.zeros(5000), mesh, [Shard(0)]), "8bit")
        small = qstate.state_like(distribute_tensor(torch.zeros(63, 64), mesh, [Shard(0)]), "8bit")
        with mode.disable():
            assert all(isinstance(t, qstate.QuantizedState) for t in _ranks(s.to_local()))
            assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in _ranks(bias.to_local()))
            assert all(type(t) is torch.Tensor for t in _ranks(small.to_local()))


def test_states_stay_on_the_local_device_when_the_mesh_is_elsewhere():
    """FSDP2 CPUOffloadPolicy: the mesh is 'cuda', the local shards live on the CPU."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = DeviceMesh("cuda", list(range(WORLD)))  # no GPU needed: the fake group never touches it
    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size([65, 129]), (129, 1), torch.float32))
    p = DTensor(torch.randn(17, 129), spec, requires_grad=False)  # rank 0's shard of 65 rows
    for s in (qstate.state_like(p, "8bit"), qstate.zeros_like(p, "4bit", signed=False), qstate.quantize(p, "fp8")):
        local = s.to_local()
        assert isinstance(local, qstate.QuantizedState)
        assert local.device.type == "cpu" and local.codes.device.type == "cpu"
        assert s.device_mesh.device_type == "cuda" and tuple(s.shape) == (65, 129)
        assert tuple(local.shape) == (17, 129)
        assert qstate.distributed.local_nbytes(s) == local.storage_nbytes()  # this rank's bytes only
    assert qstate.distributed.local_nbytes(p) == 17 * 129 * 4
    assert torch.equal(qstate.quantize(p, "8bit").to_local().dequantize(), qstate.quantize(p.to_local(), "8bit").dequantize())


def test_optimizer_step_on_simulated_ranks_equals_the_unsharded_step():
    # under LocalTensorMode DTensor calls the op on the LocalTensor shards (the mode runs it per rank)
    # as on a real rank's shards; rows 10 over 4 ranks
    # are uneven, and 8-bit blocks never cross rows, so every shard's update is exact
    from qstate.optim import AdamW

    torch.manual_seed(0)
    full, grads = torch.randn(10, 300), [torch.randn(10, 300) for _ in range(2)]
    ref = torch.nn.Parameter(full.clone())
    ref_opt = AdamW([ref], lr=1e-2, state_format="8bit")
    for g in grads:
        ref.grad = g.clone()
        ref_opt.step()
    with local_tensor.LocalTensorMode(WORLD):
        mesh = init_device_mesh("cpu", (4,))
        p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
        opt = AdamW([p], lr=1e-2, state_format="8bit")
        for g in grads:
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            opt.step()
        params = _ranks(p.full_tensor())
        exp_avgs = _ranks(opt.state[p]["exp_avg"].full_tensor())
    assert len(params) == WORLD and all(torch.equal(x, ref.detach()) for x in params)
    want = ref_opt.state[ref]["exp_avg"].dequantize()
    assert all(torch.equal(x.dequantize(), want) for x in exp_avgs)


@pytest.mark.parametrize("fmt,dtype,compile", [("8bit", torch.float32, True), ("4bit", torch.bfloat16, True),
                                               ("4bit", torch.bfloat16, False)])
def test_step_on_simulated_ranks_with_empty_shards_equals_the_unsharded_step(fmt, dtype, compile):
    # on 4 simulated ranks: a [2, 4096] parameter leaves ranks 2 and 3 empty shards (DTensor's strategy for
    # qstate::fused_update keeps them), a [10, 600] one uneven shards; every rank equals the unsharded
    # steps bit for bit, states included, and the steps issue no collectives. With 4-bit states (stochastic
    # first moments) and bf16 stochastic rounding, each shard draws by its place in the full parameter:
    # its start (qstate.dtensor_rules.flat_starts) in the fused kernels, its indices op by op.
    from qstate.optim import AdamW

    torch.manual_seed(0)
    fulls = [torch.randn(10, 600).to(dtype), torch.randn(2, 4096).to(dtype)]
    grads = [[torch.randn(f.shape).to(dtype) for f in fulls] for _ in range(3)]
    kwargs = dict(lr=1e-2, state_format=fmt, compile=compile, seed=5, bf16_stochastic_round=dtype == torch.bfloat16)
    refs = [torch.nn.Parameter(f.clone()) for f in fulls]
    ref_opt = AdamW(refs, **kwargs)
    for step_grads in grads:
        for r, g in zip(refs, step_grads):
            r.grad = g.clone()
        ref_opt.step()
    with local_tensor.LocalTensorMode(WORLD):
        mesh = init_device_mesh("cpu", (4,))
        ps = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
        opt = AdamW(ps, **kwargs)
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            with CommDebugMode() as comm:
                opt.step()
            assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert ps[1].to_local()._local_tensors[3].numel() == 0
        params = [_ranks(p.full_tensor()) for p in ps]
        exp_avgs = [_ranks(opt.state[p]["exp_avg"].full_tensor()) for p in ps]
    for ranks, avgs, ref in zip(params, exp_avgs, refs):
        assert len(ranks) == WORLD and all(torch.equal(x, ref.detach()) for x in ranks)
        want = ref_opt.state[ref]["exp_avg"]
        assert all(torch.equal(x.codes, want.codes) and torch.equal(x.scale, want.scale) for x in avgs)


def test_optimizer_step_runs_parameters_the_op_rejects_op_by_op():
    # a gradient laid out unlike its parameter: qstate::fused_update rejects the batch before writing
    # anything (LayoutMismatch); the step runs that parameter's math op by op, equal to the unsharded
    # eager step (compile=False), and the other one's through the op, equal to the unsharded fused
    # step (the two paths differ in the last bit here, which tells them apart)
    from qstate.optim import AdamW

    torch.manual_seed(0)
    fulls = [torch.randn(10, 300), torch.randn(6, 512)]
    grads = [[torch.randn(f.shape) for f in fulls] for _ in range(2)]
    refs = {}
    for compile in (True, False):
        refs[compile] = [torch.nn.Parameter(f.clone()) for f in fulls]
        ref_opt = AdamW(refs[compile], lr=1e-2, state_format="8bit", compile=compile)
        for step_grads in grads:
            for r, g in zip(refs[compile], step_grads):
                r.grad = g.clone()
            ref_opt.step()
    with local_tensor.LocalTensorMode(WORLD):
        mesh = init_device_mesh("cpu", (4,))
        ps = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
        opt = AdamW(ps, lr=1e-2, state_format="8bit")
        for step_grads in grads:
            ps[0].grad = distribute_tensor(step_grads[0].clone(), mesh, [Shard(0)])
            ps[1].grad = distribute_tensor(step_grads[1].clone(), mesh, [Replicate()])
            opt.step()
        params = [_ranks(p.full_tensor()) for p in ps]
    for ranks, ref in zip(params, (refs[True][0], refs[False][1])):
        assert len(ranks) == WORLD and all(torch.equal(x, ref.detach()) for x in ranks)
    assert not torch.equal(refs[True][1], refs[False][1])


def test_optimizer_step_is_one_op_call_that_dtensor_runs_on_the_shards():
    # rank 0 of the fake world: each step calls qstate::fused_update once for its two DTensor
    # parameters of one kind (as torch's fused AdamW calls _fused_adamw_ once), and through its sharding strategy
    # DTensor runs it on the local shards; every step equals the unsharded steps' rows that rank 0 holds
    # (rows 0-2 of 10 and of 11 over 4 ranks), under a dispatch mode or not.
    from torch.utils._python_dispatch import TorchDispatchMode

    fused_update = torch.ops.qstate.fused_update.default
    from qstate.optim import AdamW

    class RecordFusedUpdate(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is fused_update:
                self.calls.append((len(args[0]), type(args[0][0]).__name__))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    fulls = [torch.randn(10, 300), torch.randn(11, 300)]
    grads = [[torch.randn_like(f) for f in fulls] for _ in range(4)]
    refs = [torch.nn.Parameter(f.clone()) for f in fulls]
    ref_opt = AdamW(refs, lr=1e-2, state_format="8bit")
    mesh = init_device_mesh("cpu", (WORLD,))

    def shard(t):
        return DTensor.from_local(t[:3].clone(), mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())

    ps = [torch.nn.Parameter(shard(f)) for f in fulls]
    opt = AdamW(ps, lr=1e-2, state_format="8bit")
    for i, step_grads in enumerate(grads):
        for ref, p, g in zip(refs, ps, step_grads):
            ref.grad, p.grad = g.clone(), shard(g)
        ref_opt.step()
        with RecordFusedUpdate() as mode:
            opt.step()
        assert mode.calls == [(2, "DTensor")], mode.calls
        for ref, p in zip(refs, ps):
            assert torch.equal(p.to_local(), ref.detach()[:3])


@pytest.mark.parametrize("name, kwargs", [
    ("AdamW", dict(lr=1e-2, state_format="8bit")),
    ("AdamW", dict(lr=1e-2, state_format="4bit")),  # stochastic 4-bit exp_avg: a hash of the value
    ("AdamW", dict(lr=1e-2, state_format="fp8")),
    ("AdamW", dict(lr=1e-2, state_format="fp32")),
    ("Lion", dict(lr=1e-3, state_format="8bit")),
    ("SGD", dict(lr=1e-2, momentum=0.9, state_format="8bit")),
    ("SGD", dict(lr=1e-2)),  # no states
])
def test_every_rule_and_format_on_dtensor_equals_the_unsharded_steps(name, kwargs):
    # rank 0 of the fake world: four steps through the op (the first builds the shards' kernel calls,
    # the later ones reuse them), each equal to the unsharded step's rows
    import qstate.optim

    torch.manual_seed(0)
    full, grads = torch.randn(10, 300), [torch.randn(10, 300) for _ in range(4)]
    mesh = init_device_mesh("cpu", (WORLD,))

    def shard(t):
        return DTensor.from_local(t[:3].clone(), mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())

    ref, p = torch.nn.Parameter(full.clone()), torch.nn.Parameter(shard(full))
    make = getattr(qstate.optim, name)
    ref_opt, opt = make([ref], **kwargs), make([p], **kwargs)
    for g in grads:
        ref.grad, p.grad = g.clone(), shard(g)
        ref_opt.step()
        opt.step()
        assert torch.equal(p.to_local(), ref.detach()[:3])


@pytest.mark.parametrize("path", ["eager", "c kernel", "op by op in the op"])
@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
def test_eager_bf16_stochastic_rounding_on_dtensors_draws_as_the_unsharded_step(placement, path, monkeypatch):
    # rank 0 of the fake world, compile=False: the op-by-op math on a DTensor draws each element by its
    # index in the full parameter (qstate::flat_index_like, whose DTensor handler gives the shard its
    # indices; then shifts, which torch's DTensor returned unchanged before the shift rule), as the
    # unsharded eager step and the fused kernels do, for any placement: rank 0's shard equals the
    # unsharded parameter's part bit for bit (float32 states: the math is elementwise on every layout).
    # compile=True: the C kernel on Shard(0) / Replicate shards through qstate::fused_update with sr_keys;
    # with the C kernel off, the small plain states run op by op inside the op, on the shard, drawing by
    # its start (before, they ran op by op on the DTensor)
    from qstate.optim import AdamW, cpu_kernel_enabled
    from qstate.optim._engine import op as _fused_op

    in_op: list = []
    eagerly = _fused_op.update_eagerly
    monkeypatch.setattr(_fused_op, "update_eagerly", lambda *a, **k: in_op.append(1) or eagerly(*a, **k))
    torch.manual_seed(0)
    full, grads = torch.randn(10, 301).bfloat16(), [torch.randn(10, 301).bfloat16() for _ in range(3)]
    mesh = init_device_mesh("cpu", (WORLD,))
    part = {Shard(0): (slice(0, 3), slice(None)), Shard(1): (slice(None), slice(0, 76))}.get(placement, ...)

    def shard(t):
        return DTensor.from_local(t[part].clone(), mesh, [placement], run_check=False, shape=t.shape, stride=t.stride())

    ref, p = torch.nn.Parameter(full.clone()), torch.nn.Parameter(shard(full))
    ref_opt, opt = (AdamW([x], lr=1e-2, state_format="fp32", bf16_stochastic_round=True, seed=3,
                          compile=path != "eager") for x in (ref, p))
    with cpu_kernel_enabled(path == "c kernel"):
        for g in grads:
            ref.grad, p.grad = g.clone(), shard(g)
            ref_opt.step()
            opt.step()
    # op by op inside the op: the plain reference's three steps, and the DTensor's where its shards are
    # ranges of the flat parameter (a Shard(1) one runs op by op on the DTensor)
    in_op_steps = 3 + (3 if placement != Shard(1) else 0) if path == "op by op in the op" else 0
    assert len(in_op) == in_op_steps
    assert torch.equal(p.to_local(), ref.detach()[part])
    nearest = torch.nn.Parameter(full.clone())
    nearest_opt = AdamW([nearest], lr=1e-2, state_format="fp32", compile=False)
    for g in grads:
        nearest.grad = g.clone()
        nearest_opt.step()
    assert not torch.equal(ref, nearest)  # the draws rounded some elements the other way

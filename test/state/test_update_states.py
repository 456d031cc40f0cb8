"""``qstate.update_states``: op-by-op updates through plain values, one encode per state.

A state updated in the block holds exactly ``qstate.quantize`` of the same ops run on its
dequantized values (one rounding, not one per op); plain tensors are written directly; a block
that raises, or a working tensor that no longer fits its state, writes nothing; DTensor states
are encoded shard by shard on uneven shards, with no communication.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate
from state_cases import values


def adam_moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
    """Adam's moment update, written op by op as torch.optim's for-loop path writes it."""
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)


def _parts(q: qstate.QuantizedState) -> tuple[torch.Tensor, torch.Tensor]:
    return q.dequantize(), q.scale


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["8bit", "4bit", "fp8"]), rows=st.integers(1, 9), cols=st.sampled_from([7, 300, 513]),
       seed=st.integers(0, 2**16))
def test_each_state_is_encoded_once_from_the_ops_on_its_values(fmt, rows, cols, seed):
    m = qstate.quantize(values((rows, cols), seed, True, torch.float32), fmt)
    v = qstate.quantize(values((rows, cols), seed + 1, False, torch.float32), fmt, signed=False)
    g = values((rows, cols), seed + 2, True, torch.float32)
    m_ref, v_ref = m.dequantize(), v.dequantize()
    adam_moments(m_ref, v_ref, g)
    with qstate.update_states([m, v]) as (m32, v32):
        assert type(m32) is torch.Tensor and m32.dtype == torch.float32
        adam_moments(m32, v32, g)
    for got, ref, signed in ((m, m_ref, True), (v, v_ref, False)):
        want = qstate.quantize(ref, fmt, signed=signed, block_size=got.block_size)
        assert isinstance(got, qstate.QuantizedState)
        assert all(torch.equal(a, b) for a, b in zip(_parts(got), _parts(want)))


def test_plain_tensors_are_handed_out_and_written_directly():
    p = torch.ones(3, 4)
    q = qstate.quantize(torch.ones(3, 4), "8bit")
    with qstate.update_states([p, q]) as (p_work, q_work):
        assert p_work is p and q_work is not q
        p_work.mul_(2)
        q_work.mul_(2)
    assert torch.equal(p, torch.full((3, 4), 2.0)) and torch.equal(q.dequantize(), torch.full((3, 4), 2.0))


def test_a_block_that_raises_writes_nothing():
    q = qstate.quantize(torch.randn(5, 300), "4bit")
    before = (q.codes.clone(), q.scale.clone())
    with pytest.raises(RuntimeError, match="inside"):
        with qstate.update_states([q]) as (w,):
            w.mul_(3)
            raise RuntimeError("raised inside the block")
    assert torch.equal(q.codes, before[0]) and torch.equal(q.scale, before[1])


class TestErrors(expecttest.TestCase):
    def test_a_working_tensor_that_no_longer_fits_writes_no_state(self):
        a, b = qstate.quantize(torch.randn(4, 8), "8bit"), qstate.quantize(torch.randn(4, 8), "8bit")
        before = [t.codes.clone() for t in (a, b)]
        with self.assertRaises(ValueError) as ctx:
            with qstate.update_states([a, b]) as (wa, wb):
                wa.mul_(2)
                wb.resize_(32)
        self.assertExpectedInline(str(ctx.exception), """\
update_states: the working values of state 1 must keep shape (4, 8), dtype torch.float32 and device cpu, got shape (32,), dtype torch.float32, device cpu; no state was written""")  # noqa: B950
        assert all(torch.equal(t.codes, c) for t, c in zip((a, b), before))

    def test_arguments(self):
        q = qstate.quantize(torch.randn(4, 8), "8bit")
        with self.assertRaises(TypeError) as ctx:
            with qstate.update_states(q):
                pass
        self.assertExpectedInline(str(ctx.exception), """\
update_states: expected a sequence of tensors, got a single tensor of shape (4, 8); pass [state]""")
        with self.assertRaises(TypeError) as ctx:
            with qstate.update_states([q], dtype=torch.int32):
                pass
        self.assertExpectedInline(str(ctx.exception), """\
update_states: expected a floating-point dtype for the working values, got torch.int32""")


def test_dtensor_states_on_uneven_shards_are_encoded_once_shard_by_shard():
    """Each DTensor state ends holding ``quantize`` of its full working values (the ops on
    DTensors may round differently from plain ops, so the reference is the DTensor run's own)."""
    local_tensor = pytest.importorskip("torch.distributed._local_tensor")
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    world = 3
    m0, v0, g = (values((130, 65), s, signed, torch.float32) for s, signed in ((1, True), (2, False), (3, True)))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", rank=0, world_size=world)
    try:
        with local_tensor.LocalTensorMode(world) as mode:
            mesh = init_device_mesh("cpu", (world,))
            md = qstate.quantize(distribute_tensor(m0, mesh, [Shard(0)]), "8bit")
            vd = qstate.quantize(distribute_tensor(v0, mesh, [Shard(0)]), "8bit", signed=False)
            gd = distribute_tensor(g, mesh, [Shard(0)])
            with CommDebugMode() as comm, qstate.update_states([md, vd]) as (mw, vw):
                adam_moments(mw, vw, gd)
            assert comm.get_total_counts() == 0
            work = [mw.full_tensor(), vw.full_tensor()]
            full = [qstate.dequantize(t).full_tensor() for t in (md, vd)]
            with mode.disable():
                for f, w, signed in zip(full, work, (True, False)):
                    want = qstate.quantize(w._local_tensors[0], "8bit", signed=signed).dequantize()
                    for r in range(world):
                        assert torch.equal(f._local_tensors[r], want)
    finally:
        if created:
            dist.destroy_process_group()

"""Seeing what the states save: ``optimizer.state_nbytes()`` against hand-counted codes, scales and maps
(plain tensors and DTensor shards on 2 gloo ranks), the first step's record on the ``qstate`` logger,
the one-time warning of a documented weak combination, and ``QuantizedState.nbytes`` (torch's logical
size) beside ``storage_nbytes()``.
"""

from __future__ import annotations

import logging
import warnings

import expecttest
import torch
import torch.distributed as dist

import qstate
from dist_utils import run_distributed
from qstate.optim import SGD, AdamW, Lion, Muon
from test_optim_cases import grads

#: a quantized matrix (200-element rows: 4 blocks of 64, the last partial), a small matrix, a bias
SHAPES = [(64, 200), (7, 9), (200,)]
MAP_8BIT = 256 * 4  # the code map: 256 float32 entries


def _stepped(opt, ps, steps: int = 1):
    for step in range(steps):
        for p, g in zip(ps, grads(ps, step)):
            p.grad = g
        opt.step()
    return opt


def _params(shapes=SHAPES):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _8bit_state_nbytes(rows: int, row_len: int, block_size: int) -> int:
    """One 8bit state by hand: a byte per element, a float32 scale per block of each row, the map."""
    return rows * row_len + rows * -(-row_len // block_size) * 4 + MAP_8BIT


def test_state_nbytes_counts_codes_scales_and_maps():
    ps = _params()
    opt = AdamW(ps, state_format="8bit", block_size=64)
    assert opt.state_nbytes().formats == {}  # no state before the first step
    nbytes = _stepped(opt, ps).state_nbytes()
    quantized = 2 * _8bit_state_nbytes(64, 200, 64)  # exp_avg and exp_avg_sq
    plain = 2 * (7 * 9 + 200)
    assert nbytes.formats["8bit"] == qstate.optim._report.FormatNbytes(
        states=2, elements=2 * 64 * 200, storage_nbytes=quantized, fp32_nbytes=2 * 64 * 200 * 4)
    assert nbytes.formats["fp32"] == qstate.optim._report.FormatNbytes(
        states=4, elements=plain, storage_nbytes=4 * plain, fp32_nbytes=4 * plain)
    assert set(nbytes.formats) == {"8bit", "fp32"}
    assert (nbytes.storage_nbytes, nbytes.fp32_nbytes) == (quantized + 4 * plain, 4 * (2 * 64 * 200 + plain))
    # 4bit: two codes a byte, float32 scales per block of 128 (default), a 16-entry map; bf16 states
    four = _stepped(SGD(ps, momentum=0.9, state_format="4bit"), ps).state_nbytes()
    assert four.formats["4bit"].storage_nbytes == 64 * 100 + 64 * 2 * 4 + 16 * 4
    bf16 = _stepped(AdamW(ps, state_format="bf16", min_quantize_numel=0), ps).state_nbytes()
    assert bf16.formats["bf16"].storage_nbytes == 2 * 2 * (64 * 200 + 7 * 9 + 200)  # 1-D too: plain format
    assert set(bf16.formats) == {"bf16"}
    # Muon: its momentum buffers and its AdamW states
    muon = _stepped(Muon(ps, state_format="8bit", block_size=64), ps).state_nbytes()
    assert muon.formats["8bit"].storage_nbytes == _8bit_state_nbytes(64, 200, 64)


def _sharded_nbytes(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _params([(65, 200), (200,)])
    ps = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in full]
    opt = AdamW(ps, state_format="8bit", block_size=64, foreach=True, state_rounding="stochastic", seed=0)
    for step in range(3):
        for p, g in zip(ps, grads(full, step)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    rows = 33 if rank == 0 else 32  # 65 rows on 2 ranks: uneven shards
    nbytes = opt.state_nbytes()
    assert nbytes.formats["8bit"].storage_nbytes == 2 * _8bit_state_nbytes(rows, 200, 64)
    assert nbytes.formats["8bit"].elements == 2 * rows * 200
    assert nbytes.formats["fp32"].storage_nbytes == 2 * 100 * 4
    total = torch.tensor([nbytes.fp32_nbytes])
    dist.all_reduce(total)
    assert int(total) == 4 * 2 * (65 * 200 + 200)
    # the foreach path on DTensors (one op call, DTensor runs the math op by op on the shards) gives the
    # unsharded for-loop run's bits, stochastic rounding included
    opt_ref = AdamW(full, state_format="8bit", block_size=64, fused=False, foreach=False,
                    state_rounding="stochastic", seed=0)
    _stepped(opt_ref, full, 3)
    for p, q in zip(ps, full):
        assert torch.equal(p.full_tensor(), q)
        for name in ("exp_avg", "exp_avg_sq"):
            got, want = opt.state[p][name].full_tensor(), opt_ref.state[q][name]
            if isinstance(want, qstate.QuantizedState):
                assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
            else:
                assert torch.equal(got, want)


def test_state_nbytes_counts_local_shards_of_dtensor_states():
    run_distributed(_sharded_nbytes, 2)


class TestReports(expecttest.TestCase):
    def test_the_first_step_logs_the_formats_and_why_some_stayed_fp32(self):
        ps = _params(SHAPES + [(5000,), (30, 40)])
        opt = AdamW(ps, state_format="8bit", block_size=64)
        with self.assertNoLogs("qstate", logging.INFO):  # a skipped step creates nothing: nothing to say
            for p, g in zip(ps, grads(ps, 0)):
                p.grad = g
            opt.step(found_inf=torch.ones(()))
        with self.assertLogs("qstate", logging.INFO) as logs:
            opt.step()
        (record,) = logs.records
        self.assertEqual(record.levelno, logging.INFO)
        self.assertExpectedInline(record.getMessage(), """AdamW: 10 states of 5 parameters: 2 8bit, 8 fp32; 8 states of 10 stayed fp32: 2 1-D (quantized states need 2 or more dims), 6 fewer than min_quantize_numel=4096 elements; 8bit: 2 states, 25,600 elements, 29,696 bytes; fp32: 8 states, 12,926 elements, 51,704 bytes; 81,400 bytes on this rank against 154,104 in float32 (52.8%)""")  # noqa: B950
        with self.assertNoLogs("qstate", logging.INFO):  # once
            opt.step()

    def test_fp32_asked_is_not_reported_as_stayed(self):
        ps = _params()
        with self.assertLogs("qstate", logging.INFO) as logs:
            _stepped(Lion(ps, state_format="fp32"), ps)
        self.assertExpectedInline(logs.records[0].getMessage(), """Lion: 3 states of 3 parameters: 3 fp32; fp32: 3 states, 13,063 elements, 52,252 bytes; 52,252 bytes on this rank against 52,252 in float32 (100.0%)""")  # noqa: B950

    def test_4bit_lion_warns_once_per_optimizer(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = Lion(_params(), state_format="4bit")
            opt.add_param_group({"params": _params([(3, 4)])})  # once per optimizer
            Lion(_params(), state_format="8bit")
            AdamW(_params(), state_format="4bit")
        (warning,) = caught
        self.assertEqual((warning.category, warning.filename), (UserWarning, __file__))
        self.assertExpectedInline(str(warning.message), """\
Lion: state_format='4bit' is a weak combination: Lion's slow momentum (m <- 0.99 m + 0.01 g) accumulates 4-bit rounding noise: 4bit Lion ends measurably above fp32 Lion where 8bit stays close (benchmarks/RESULTS.md); use state_format='8bit' for Lion""")  # noqa: B950
        with warnings.catch_warnings(record=True) as caught:  # a group of its own asks alike
            warnings.simplefilter("always")
            Lion([{"params": _params([(3, 4)])}, {"params": _params(), "state_format": "4bit"}])
        self.assertEqual(len(caught), 1)


def test_quantized_state_nbytes_is_torchs_logical_size():
    # nbytes is numel * itemsize, as torch's code (DCP's loaders) assumes of every tensor;
    # storage_nbytes() and state_nbytes() say what the state holds
    state = qstate.zeros_like(torch.zeros(64, 1000), "8bit", signed=True, dtype=torch.float32)
    assert state.nbytes == 64 * 1000 * 4
    assert state.storage_nbytes() == 64 * 1000 + 64 * 4 * 4 + MAP_8BIT

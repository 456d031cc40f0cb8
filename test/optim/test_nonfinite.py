"""Non-finite values: how quantized states store them, and skipping steps on non-finite gradients.

References: the storage rule computed per block in plain torch (an infinity
decodes to the infinity of its sign, NaN stays NaN, the rest of such a block
is NaN; finite blocks as if quantized alone), the other execution paths
(``quantize`` against ``copy_``, the C kernel against the eager op-by-op
step), and states snapshotted before a skipped step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import qstate
import qstate.amp
import qstate.optim
from dist_utils import run_distributed
from state_cases import written_by_update

INF, NAN = float("inf"), float("nan")

#: (format, signed, rounding): every rounding each format implements
KINDS = [("8bit", True, "nearest"), ("8bit", True, "stochastic"), ("8bit", False, "nearest"),
         ("4bit", True, "nearest"), ("4bit", True, "stochastic"), ("4bit", False, "nearest"),
         ("fp8", True, "nearest"), ("fp8", False, "nearest")]


def _rows_with_non_finite_blocks(block: int) -> torch.Tensor:
    """Rows of 3 blocks (the last partial): finite blocks, and blocks holding +-inf, NaN, or both."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3 * block - 3, generator=gen)
    x[0, 1], x[0, block + 2] = INF, -INF                 # an infinity of each sign, blocks 0 and 1
    x[1, 3] = NAN                                        # a NaN alone
    x[2, block], x[2, block + 5], x[2, 7] = NAN, -INF, INF  # a NaN beside an infinity, and +inf elsewhere
    x[3, 2 * block + 1] = -INF                           # the partial block
    x[4, :block] = torch.tensor([INF, -INF] * (block // 2))  # a block of infinities only
    return x


def _expected(x: torch.Tensor, fmt: str, signed: bool, rounding: str, block: int) -> torch.Tensor:
    """The storage rule, block by block: finite blocks decode as they do alone; a block holding an
    infinity decodes its infinities to their sign's (unsigned: -inf to NaN) and the rest to NaN; a
    block holding a NaN and no infinity decodes to NaN."""
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for b0 in range(0, x.shape[1], block):
            blk = x[r, b0:b0 + block]
            if blk.isinf().any():
                keep = (blk == INF) | ((blk == -INF) & signed)
                out[r, b0:b0 + block] = torch.where(keep, blk, NAN)
            elif blk.isnan().any():
                out[r, b0:b0 + block] = NAN
            else:
                alone = qstate.quantize(blk.view(1, -1), fmt, signed=signed, rounding=rounding, block_size=block)
                out[r, b0:b0 + block] = alone.dequantize().view(-1)
    return out


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN (any payload)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("fmt, signed, rounding", KINDS)
def test_quantize_and_copy_keep_infinities_and_nans(fmt, signed, rounding):
    block = 64
    x = _rows_with_non_finite_blocks(block)
    if not signed:
        x = torch.where(x.isnan(), x, x.abs()).where(x != -INF, -INF)  # second moments: >= 0, one -inf
    q = qstate.quantize(x, fmt, signed=signed, rounding=rounding, block_size=block)
    assert _same_values(q.dequantize(), _expected(x, fmt, signed, rounding, block))
    # copy_ writes the same codes and scales into an existing state
    dst = qstate.zeros_like(x, fmt, signed=signed, rounding=rounding, block_size=block)
    dst.copy_(x)
    assert torch.equal(dst.codes, q.codes) and torch.equal(dst.scale.isnan(), q.scale.isnan())
    assert torch.equal(dst.scale.nan_to_num(0.0), q.scale.nan_to_num(0.0))


def test_quantize_of_the_reported_values():
    # the sign of -inf was lost ([nan, inf, nan, nan]): -inf now decodes as -inf, its block's finite values as NaN
    for fmt in ("8bit", "4bit", "fp8"):
        got = qstate.quantize(torch.tensor([1.0, -INF, 2.0, -3.0]), fmt).dequantize()
        assert _same_values(got, torch.tensor([NAN, -INF, NAN, NAN])), (fmt, got)


def _step_on_infinite_states(fmt: str, rounding, compile: bool, steps: int):
    """AdamW steps whose first gradient puts +-inf and NaN into the states, then steps that read them."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(4, 520, generator=gen)
    opt = qstate.optim.AdamW([p], lr=0.1, state_format=fmt, state_rounding=rounding, min_quantize_numel=0,
                             compile=compile, seed=0)
    for step in range(steps):
        g = torch.randn(4, 520, generator=gen)
        if step == 0:
            g[0, 3], g[1, 300], g[2, 5], g[3, 10], g[3, 20], g[3, 517] = NAN, INF, -INF, NAN, -INF, INF
        p.grad = g
        opt.step()
    return p, opt.state[p]


def _pattern_and_values(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    """The same NaNs and the same infinities with the same signs; finite values within ``atol``: the eager
    ops and the fused kernels may round the update's float32 math differently in the last bit, which can
    move a value across a code threshold (the bits of each path's encode: the test below)."""
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
    assert torch.equal(a[a.isinf()], b[b.isinf()])
    torch.testing.assert_close(a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0), rtol=0, atol=atol)


@pytest.mark.parametrize("fmt, rounding", [("8bit", "nearest"), ("8bit", "stochastic"), ("4bit", "stochastic"),
                                           ("4bit", "nearest"), ("fp8", None)])
def test_states_holding_infinities_step_alike_compiled_and_eager(fmt, rounding):
    # compile=True (the C kernel on CPU) and compile=False (op by op, writing states with copy_): the same
    # infinities and NaNs in parameters and both moments, after steps that read states holding +-inf
    for steps in (1, 3):
        (p, st), (ref_p, ref_st) = (_step_on_infinite_states(fmt, rounding, compile, steps)
                                    for compile in (True, False))
        _pattern_and_values(p.detach(), ref_p.detach(), atol=0.3)  # 3 steps of lr 0.1
        for name in ("exp_avg", "exp_avg_sq"):  # within a code step of 4bit's maps
            _pattern_and_values(st[name].dequantize(), ref_st[name].dequantize(), atol=0.35)
        m = st["exp_avg"].dequantize()
        if steps == 1:  # the first moment's infinities, with their signs
            assert m[2, 5] == -INF and m[3, 20] == -INF and m[1, 300] == INF and m[3, 517] == INF
        assert m[0, 300:].isfinite().all()  # a block that never held a non-finite value


@pytest.mark.parametrize("fmt, rounding", [("8bit", "nearest"), ("8bit", "stochastic"), ("4bit", "stochastic"),
                                           ("4bit", "nearest"), ("fp8", "nearest")])
def test_compiled_step_encodes_non_finite_values_as_quantize(fmt, rounding):
    # SGD's first momentum buffer is the gradient itself, so the fused kernel's codes and scales (the C kernel
    # on CPU: its scalar encode for non-finite blocks, its vector encodes for the others) must be
    # the gradient written into a fresh state (stochastic rounding: by position under the update's key), bit
    # for bit; blocks of 100: 64- 16- and 8-lane loops and scalar tails
    g = _rows_with_non_finite_blocks(100)
    p = torch.zeros_like(g)
    buf = qstate.zeros_like(p, fmt, block_size=100, rounding=rounding)
    torch.manual_seed(3)
    qstate.optim.functional.sgd([p], [g.clone()], [buf], [1], lr=0.1, momentum=0.9, compile=True)
    ref = written_by_update(g, fmt, seed=3, rounding=rounding, block_size=100)
    assert torch.equal(buf.codes, ref.codes)
    assert torch.equal(buf.scale.view(torch.int32), ref.scale.view(torch.int32))


# ---------------------------------------------------------------------------------------- skip_nonfinite
def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(65, 130, generator=gen)), nn.Parameter(torch.randn(7, generator=gen))]


def _grads(step: int, bad: float | None = None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    gs = [torch.randn(65, 130, generator=gen), torch.randn(7, generator=gen)]
    if bad is not None:
        gs[0][3, 17] = bad
    return gs


def _snapshot(opt: torch.optim.Optimizer, ps: list[nn.Parameter]) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in ps]
    for p in ps:
        for v in opt.state.get(p, {}).values():
            v = v.to_local() if hasattr(v, "to_local") else v
            out += [v.codes.clone(), v.scale.clone()] if isinstance(v, qstate.QuantizedState) else [v.clone()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("compile", [True, False])
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_skip_nonfinite_leaves_params_states_and_steps_bit_identical(fmt, compile, bad):
    # plain parameters, quantized states (the [65, 130] weight) and a plain fp32 state (the bias); a bad
    # gradient on the first step (nothing created) and on the third (nothing written); the run then equals
    # one that never saw the bad gradients
    make = lambda ps: qstate.optim.AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0, compile=compile,
                                         skip_nonfinite=True, seed=0)  # one rounding stream
    ps, ref_ps = _params(), _params()
    opt, ref = make(ps), make(ref_ps)
    for step in range(5):
        if step in (0, 2):
            before = _snapshot(opt, ps)
            for p, g in zip(ps, _grads(step, bad)):
                p.grad = g
            opt.step()
            assert _same(_snapshot(opt, ps), before), step
            assert step or not opt.state
        for p, g in zip(ps, _grads(step)):
            p.grad = g
        for p, g in zip(ref_ps, _grads(step)):
            p.grad = g
        opt.step()
        ref.step()
    assert _same(_snapshot(opt, ps), _snapshot(ref, ref_ps))
    assert int(opt.state[ps[0]]["step"]) == 5


def test_without_skip_nonfinite_a_nan_gradient_reaches_its_blocks():
    # the default applies the gradient: a NaN makes the blocks holding it NaN in both moments (8bit: one
    # block per row of 130), so the step after makes the parameter's whole row NaN; other rows stay finite
    ps = _params()
    opt = qstate.optim.AdamW(ps, lr=1e-2, state_format="8bit", min_quantize_numel=0)
    for step in range(2):
        for p, g in zip(ps, _grads(step, NAN if step == 0 else None)):
            p.grad = g
        opt.step()
    m, v = (opt.state[ps[0]][n].dequantize() for n in ("exp_avg", "exp_avg_sq"))
    assert m[3].isnan().all() and v[3].isnan().all() and ps[0][3].isnan().all()
    rest = torch.cat([torch.arange(3), torch.arange(4, 65)])
    assert m[rest].isfinite().all() and v[rest].isfinite().all() and ps[0][rest].isfinite().all()


class _CountChecks(TorchDispatchMode):
    """Counts the non-finite checks of gradients (qstate.amp.found_non_finite's one op per device and dtype)."""

    def __init__(self):
        super().__init__()
        self.checks = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            self.checks += 1
        return func(*args, **(kwargs or {}))


def test_skip_nonfinite_uses_a_scalers_found_inf_without_reading_gradients():
    ps = _params()
    opt = qstate.optim.AdamW(ps, lr=1e-2, min_quantize_numel=0, skip_nonfinite=True)
    for p, g in zip(ps, _grads(0, NAN)):
        p.grad = g
    with _CountChecks() as counted:
        opt.step(found_inf=torch.zeros(()))  # the scaler's verdict stands: the step is taken
    assert counted.checks == 0 and ps[0][3].isnan().any()
    before = _snapshot(opt, ps)
    with _CountChecks() as counted:
        opt.step()  # no scaler: the step checks (one device, one dtype), finds the NaN now in the gradient, skips
    assert counted.checks == 1
    for a, b in zip(_snapshot(opt, ps), before):  # skipped: bit for bit (the NaNs of the first step included)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_skip_nonfinite_must_be_a_bool():
    with pytest.raises(TypeError, match="AdamW: skip_nonfinite must be a bool, got 1"):
        qstate.optim.AdamW(_params(), skip_nonfinite=1)


def skip_on_one_rank_body(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 130), nn.ReLU(), nn.Linear(130, 7))
    fully_shard(model)
    opt = qstate.optim.AdamW(model.parameters(), lr=1e-2, min_quantize_numel=100, skip_nonfinite=True)

    def backward(step: int) -> None:
        x = torch.randn(8, 33, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()

    backward(0)
    opt.step()
    opt.zero_grad()
    backward(1)
    if rank == 1:  # only rank 1's shard of the first weight's gradient holds a NaN
        next(model.parameters()).grad.to_local().view(-1)[0] = NAN
    before = _snapshot(opt, list(model.parameters()))
    opt.step()
    assert _same(_snapshot(opt, list(model.parameters())), before), rank
    assert all(int(s["step"]) == 1 for s in opt.state.values())
    opt.zero_grad()
    backward(2)
    opt.step()  # finite gradients: taken on both ranks
    assert all(int(s["step"]) == 2 for s in opt.state.values())
    assert all(p.to_local().isfinite().all() for p in model.parameters())


def test_skip_nonfinite_skips_on_every_rank_when_one_ranks_gradient_has_a_nan():
    run_distributed(skip_on_one_rank_body, 2)

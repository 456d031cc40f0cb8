"""qstate optimizers on FSDP2-sharded models match the unsharded run, in real gloo processes.

Inside each rank, a ``fully_shard``-ed model (layers 129 -> 65 -> 16 -> 7: first
dims not divisible by 2 or 3, 1-D biases) trains for a few steps next to an
unsharded copy of the same model, optimizer and data (no extra process).

Exactness. Every rank feeds the same batch, so the FSDP gradient is gloo's
``ReduceOp.AVG`` of ``world_size`` identical gradients: their sum, then a
division, in the gradient's dtype. That is ``g`` for 2 ranks but not always for
3 (``fl(3g) / 3 != g``), so the unsharded run applies ``(g * world_size) /
world_size`` (``g + g`` is exact, so ``fl(3g)`` is gloo's sum in any order) and
the comparison can be exact. With ``MixedPrecisionPolicy(param_dtype=bf16)``
the unsharded run computes with a bfloat16 copy of its float32 parameters, as
FSDP2 does (bf16 forward and backward, bf16 reduction, float32 sharded
gradient). Both sides use the same ``compile`` setting: ``compile=False`` runs
the math op by op (on DTensors through their ops), ``compile=True`` the fused
kernels (on DTensors through ``qstate::fused_update``, shard by shard); the
two may round differently (FMA, reassociation), so each is compared with its
own kind. No step issues a collective (CommDebugMode).

What is exact, per config: losses, gradients, parameters and every state's
``full_tensor()`` (codes and scales of quantized states) equal the unsharded
run's bit for bit, for fp32 *and* 8-bit states: quantization blocks never cross
rows and FSDP2 shards whole rows, so each shard quantizes the same blocks from
the same values. bfloat16 parameters with stochastic rounding draw their random
bits from a hash of a per-parameter key (the one the unsharded parameter at the
same position gets, from the optimizer's seed) and each element's index in the
full parameter (``qstate::flat_index_like``, which DTensor computes shard by
shard): op by op with ``compile=False``, in the shards' fused kernel with
``compile=True`` (the C kernel, or with ``c_kernel=False`` the inductor
kernel). So the shards round independently (as slices of one full-tensor draw)
and the sharded run equals the unsharded run bit for bit. The step must not
call ``DTensor.to_local``/``from_local``.

Within noise: with another seed the unsharded bf16 run rounds the first update
to the same or the adjacent bfloat16 value.

All configs of one world size run in one spawned job (spawning dominates the cost).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterator, NamedTuple

import pytest
import torch
import torch.nn as nn

from dist_utils import run_distributed
from optim_db import find
from qstate.formats import FORMATS
from qstate.optim import cpu_kernel_enabled

STEPS = 3
SEED = 1234


@dataclasses.dataclass(frozen=True)
class Config:
    #: the optimizer class's name: its ``optim_db`` entry's first input gives its arguments
    optimizer: str = "AdamW"
    state_format: str = "fp32"
    param_dtype: torch.dtype = torch.float32
    offload: bool = False
    mixed_precision: bool = False
    #: 100: the three weights get quantized states, the biases (65, 16, 7) float32 ones (1-D
    #: parameters keep float32 states at any size: test_optimizer_policy_keeps_1d_states_plain)
    min_quantize_numel: int = 100
    #: fused compiled kernels: DTensor runs qstate::fused_update shard by shard
    compile: bool = False
    #: with ``compile``, the CPU C kernel where it takes the kernel spec (False: the inductor kernel)
    c_kernel: bool = True

    @property
    def stochastic_round(self) -> bool:
        return self.param_dtype == torch.bfloat16

    def __str__(self) -> str:
        dtype = str(self.param_dtype).removeprefix("torch.")
        return (f"{self.optimizer}({self.state_format}, min_quantize_numel={self.min_quantize_numel}) {dtype} "
                f"params{' +offload' if self.offload else ''}{' +mp(bf16)' if self.mixed_precision else ''}"
                f"{' compiled' if self.compile else ''}{' (inductor)' if not self.c_kernel else ''}")


#: what ``test_optim_db.py``'s FSDP2 run (every optimizer x 8bit/4bit/fp8/fp32 states, float32
#: parameters, op by op) leaves out: AdamW with every combination of offload and mixed precision; bf16
#: parameters (already in the policy's dtype, so no mixed precision) with fp32 states, and with 8-bit
#: states and offload; AdamW, Lion and SGD (momentum, Nesterov) compiled
CONFIGS = [
    Config("AdamW", fmt, torch.float32, offload, mp)
    for fmt in ("fp32", "8bit")
    for offload in (False, True)
    for mp in (False, True)
    if offload or mp
] + [
    Config("AdamW", "fp32", torch.bfloat16),
    Config("AdamW", "8bit", torch.bfloat16, offload=True),
    Config("AdamW", "8bit", compile=True),
    Config("AdamW", "4bit", offload=True, mixed_precision=True, compile=True),
    Config("Lion", "8bit", compile=True),
    Config("SGD", "4bit", compile=True),
    # bf16 stochastic rounding on the shards' C kernel: draws by each element's place in the full parameter
    Config("AdamW", "8bit", torch.bfloat16, compile=True),
    Config("AdamW", "4bit", torch.bfloat16, offload=True, compile=True),
]
#: the configurations whose shards compile inductor kernels (a cold compile per rank): the exhaustive run's
INDUCTOR_CONFIGS = [
    Config("AdEMAMix", "8bit", compile=True),
    Config("AdamW", "8bit", torch.bfloat16, compile=True, c_kernel=False),  # the inductor kernel draws alike
]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(129, 65), nn.ReLU(), nn.Linear(65, 16), nn.ReLU(), nn.Linear(16, 7)]
    return nn.Sequential(*layers).to(dtype)


def _batch(step: int) -> torch.Tensor:
    """The same batch on every rank."""
    return torch.randn(4, 129, generator=torch.Generator().manual_seed(100 + step))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def _optimizer(params, cfg: Config, seed: int = SEED) -> torch.optim.Optimizer:
    info = find(cfg.optimizer)
    seeding = dict(bf16_stochastic_round=cfg.stochastic_round, seed=seed) if info.takes_seed else {}
    return info.optim_cls(params, **info.fsdp_input.kwargs, state_format=cfg.state_format,
                          min_quantize_numel=cfg.min_quantize_numel, compile=cfg.compile, **seeding)


def _sharded(cfg: Config) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if cfg.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if cfg.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    model = _model(cfg.param_dtype)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


@contextlib.contextmanager
def _no_local_tensor_access() -> Iterator[None]:
    """Fail on ``DTensor.to_local``/``from_local``: the step must run on DTensors op by op."""
    from torch.distributed.tensor import DTensor

    def forbidden(*args, **kwargs):
        raise AssertionError("the optimizer step called DTensor.to_local/from_local")

    to_local, from_local = DTensor.to_local, DTensor.__dict__["from_local"]
    DTensor.to_local, DTensor.from_local = forbidden, staticmethod(forbidden)
    try:
        yield
    finally:
        DTensor.to_local, DTensor.from_local = to_local, from_local


def _full(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


class Run(NamedTuple):
    losses: list[torch.Tensor]
    model: nn.Module
    opt: torch.optim.Optimizer
    #: per parameter, after the first step: full ``param``, ``grad`` and states (stochastically rounded
    #: runs only, which ``_assert_one_ulp_apart`` compares; empty otherwise)
    first: list[dict[str, torch.Tensor]]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: _full(v).clone() for k, v in [("param", p.detach()), ("grad", p.grad), *opt.state[p].items()]
             if k != "step"} for p in model.parameters()]


def _train_sharded(cfg: Config) -> Run:
    from torch.distributed.tensor.debug import CommDebugMode

    model = _sharded(cfg)
    opt = _optimizer(model.parameters(), cfg)
    losses, first = [], []
    for step in range(STEPS):
        loss = _loss(model(_batch(step).to(cfg.param_dtype)))
        loss.backward()
        # the first step creates the states (wrapping local states is allowed there); no step communicates
        with _no_local_tensor_access() if step else contextlib.nullcontext(), CommDebugMode() as comm, \
                cpu_kernel_enabled(cfg.c_kernel):
            opt.step()
        # an elementwise update reads each shard's own elements (Muon's gathers its matrices: test_optim_muon.py)
        assert not find(cfg.optimizer).elementwise or comm.get_total_counts() == 0, \
            f"{cfg}: the step issued {comm.get_comm_counts()}"
        if cfg.stochastic_round and not first:
            first = _snapshot(model, opt)
        opt.zero_grad()
        losses.append(loss.detach())
    return Run(losses, model, opt, first)


def _train_unsharded(cfg: Config, world_size: int, seed: int = SEED) -> Run:
    """The unsharded run, with FSDP2's gradient reduction and mixed precision reproduced (module doc)."""
    master = _model(cfg.param_dtype)  # what the optimizer updates
    compute = copy.deepcopy(master).bfloat16() if cfg.mixed_precision else master
    opt = _optimizer(master.parameters(), cfg, seed)
    losses, first = [], []
    for step in range(STEPS):
        loss = _loss(compute(_batch(step).to(next(compute.parameters()).dtype)))
        loss.backward()
        for pm, pc in zip(master.parameters(), compute.parameters()):
            g, pc.grad = pc.grad, None
            # gloo AVG of world_size identical gradients, in the gradient's dtype
            pm.grad = ((g * world_size) / world_size).to(pm.dtype)
        with cpu_kernel_enabled(cfg.c_kernel):
            opt.step()
        if cfg.stochastic_round and not first:
            first = _snapshot(master, opt)
        opt.zero_grad()
        if compute is not master:
            with torch.no_grad():
                for pm, pc in zip(master.parameters(), compute.parameters()):
                    pc.copy_(pm)
        losses.append(loss.detach())
    return Run(losses, master, opt, first)


# ------------------------------------------------------------------ comparisons
def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> bool:
    """Bit-equal full tensors (quantized: same kind, codes and scales); returns whether quantized."""
    import qstate

    got, want = _full(got), _full(want)
    assert type(got) is type(want), f"{what}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, qstate.QuantizedState):
        assert got.describe() == want.describe(), f"{what}: {got.describe()} != {want.describe()}"
        assert torch.equal(got.codes, want.codes), f"{what}: codes differ"
        assert torch.equal(got.scale, want.scale), f"{what}: scales differ"
        return True
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{what}: {got.dtype} vs {want.dtype}, max |diff| {(got.double() - want.double()).abs().max().item()}"
    return False


def _assert_same_run(run: Run, ref: Run, cfg: Config) -> None:
    assert torch.equal(torch.stack(run.losses), torch.stack(ref.losses)), \
        f"{cfg}: losses {torch.stack(run.losses).tolist()} != {torch.stack(ref.losses).tolist()}"
    names = [n for n, _ in ref.model.named_parameters()]
    quantized = 0
    for name, p, q in zip(names, run.model.parameters(), ref.model.parameters()):
        _assert_equal(p.detach(), q.detach(), f"{cfg}: param {name}")
        state, ref_state = run.opt.state[p], ref.opt.state[q]
        assert sorted(state) == sorted(ref_state), f"{cfg}: param {name}: states {sorted(state)}"
        for key in sorted(ref_state):
            quantized += _assert_equal(state[key], ref_state[key], f"{cfg}: param {name} state {key!r}")
    want = 3 * find(cfg.optimizer).fsdp_input.matrix_states if cfg.state_format in FORMATS else 0
    assert quantized == want, f"{cfg}: {quantized} quantized states, expected {want}"


def _assert_one_ulp_apart(run: Run, ref: Run, cfg: Config) -> None:
    """After one step from equal values, two stochastic roundings of the same float32 result are
    equal or adjacent bfloat16 values; another random stream makes some of them differ."""
    differ = 0
    for i, (got, want) in enumerate(zip(run.first, ref.first)):
        apart = (got["param"].view(torch.int16).int() - want["param"].view(torch.int16).int()).abs()
        assert apart.max() <= 1, f"{cfg}: param {i}: first steps {apart.max().item()} bf16 ulps apart"
        differ += int(apart.count_nonzero())
    assert differ > 0, f"{cfg}: two random streams rounded every element alike"


def parity_body(rank: int, world_size: int, configs: list[Config]) -> None:
    import qstate  # noqa: F401  (installs the DTensor rules)

    streams_checked = False
    for cfg in configs:
        run = _train_sharded(cfg)
        ref = _train_unsharded(cfg, world_size)
        _assert_same_run(run, ref, cfg)
        if cfg.stochastic_round and not streams_checked:  # once per job: two more runs
            _assert_same_run(_train_sharded(cfg), run, cfg)  # same seed, same run
            _assert_one_ulp_apart(run, _train_unsharded(cfg, world_size, seed=SEED + 1), cfg)
            streams_checked = True


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_optimizer_matches_unsharded_run(world_size):
    run_distributed(parity_body, world_size, CONFIGS)


@pytest.mark.exhaustive  # inductor compiles on every rank
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_optimizer_on_inductor_kernels_matches_unsharded_run(world_size):
    run_distributed(parity_body, world_size, INDUCTOR_CONFIGS)


def test_optimizer_policy_keeps_1d_states_plain():
    import qstate
    import qstate.optim

    params = [nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(3, 100))]
    opt = qstate.optim.AdamW(params, state_format="8bit", min_quantize_numel=100, compile=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    got = [isinstance(opt.state[p]["exp_avg"], qstate.QuantizedState) for p in params]
    assert got == [qstate.wants_quantized(p, 100) for p in params] == [False, True]

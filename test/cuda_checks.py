"""CUDA checks, for machines that have a GPU (not collected by pytest; CI has no GPU).

    python test/cuda_checks.py        # one GPU is enough; runs every check, exits non-zero if any failed

Each check prints one line. They cover the paths the CPU suite can only reach
with FakeTensors: the FSDP2 + CPUOffloadPolicy + compiled 8-bit step with a
CUDA ``lr`` tensor (the field's "two different devices" crash), gradient
scaling with CPU-offloaded gradients and a CUDA scale, the compiled kernels
on CUDA against eager, bf16 stochastic rounding on CUDA DTensor shards (the
inductor kernel's draws by place), prepared inductor-kernel calls against the
full path, and loading CPU-saved states onto CUDA.
"""

from __future__ import annotations

import copy
import io
import os
import sys
import traceback

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import qstate  # noqa: E402
import qstate.amp  # noqa: E402
import qstate.optim  # noqa: E402


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(129, 65), nn.ReLU(), nn.Linear(65, 7)).to(device)


def _fsdp_offloaded(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 129, generator=torch.Generator().manual_seed(step)).cuda()


def check_offload_compiled_step_with_cuda_lr() -> None:
    model = _fsdp_offloaded(_model("cuda"))
    opt = qstate.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), state_format="8bit",
                             min_quantize_numel=100)
    ref = _model("cpu")
    ref_opt = qstate.optim.AdamW(ref.parameters(), lr=1e-2, state_format="8bit", min_quantize_numel=100)
    for step in range(3):
        model(_batch(step)).square().mean().backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            # the reference steps on the same (CPU-offloaded) gradients: a CPU backward differs in
            # the last bits from the GPU's, and a moved bit can flip an 8-bit code
            r.grad = p.grad.full_tensor()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.to_local().device.type == "cpu"
        torch.testing.assert_close(p.full_tensor().cpu(), r.detach(), rtol=0, atol=0)
    for st in opt.state.values():
        assert all(v.device.type == "cpu" for v in st.values())


def check_grad_scaler_with_offloaded_grads() -> None:
    model = _fsdp_offloaded(_model("cuda"))
    opt = qstate.optim.AdamW(model.parameters(), lr=1e-2, state_format="8bit", min_quantize_numel=100)
    scaler = qstate.amp.GradScaler("cuda", init_scale=2.0**10)
    for step in range(4):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(_batch(step)).float().square().mean()
        scaler.scale(loss).backward()
        if step == 3:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
            before = [p.to_local().clone() for p in model.parameters()]
            scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))


def check_compiled_kernels_equal_eager_on_cuda() -> None:
    # 4bit's default (stochastic) first moment draws by place under the step's key on both paths, so the
    # paths part only where a value computed differently in the last bit (ATen's lerp fuses its multiply-add)
    # crosses a draw's threshold, as rarely as a round-to-nearest midpoint
    for fmt, rounding in (("8bit", None), ("4bit", None), ("4bit", "nearest"), ("fp8", None)):
        runs = []
        for compile in (True, False):
            torch.manual_seed(0)
            ps = [nn.Parameter(torch.randn(65, 257, device="cuda")), nn.Parameter(torch.randn(33, 7, device="cuda"))]
            opt = qstate.optim.AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0, compile=compile,
                                     state_rounding=rounding, seed=0)
            for step in range(3):
                for p in ps:
                    p.grad = torch.randn(p.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                opt.step()
            runs.append([opt.state[p][name] for p in ps for name in ("exp_avg", "exp_avg_sq")])
        for a, b in zip(*runs):
            agree = (a.codes == b.codes).float().mean().item()
            assert agree > 0.999, (fmt, rounding, agree)


def check_bf16_stochastic_rounding_on_cuda_shards() -> None:
    # the inductor kernel's draws (a hash of key and flat index in int64 ops) are the CPU's, and a CUDA
    # DTensor parameter rounds through qstate::fused_update with the plain parameter's key: the same bits
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from qstate._random import position_draws

    key = torch.tensor(-0x123456789ABCDEF, dtype=torch.int64)
    index = torch.randint(0, 2**40, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(position_draws(key.cuda(), index.cuda()).cpu(), position_draws(key, index))
    mesh = init_device_mesh("cuda", (1,))
    runs = []
    for sharded in (False, True):
        torch.manual_seed(0)
        # a quantized weight (the inductor kernel) and a bias with small plain states (op by op: on the
        # DTensor's shards inside the op, drawing by place, against the plain bias's eager update)
        ps = [nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]) if sharded else w)
              for w in (torch.randn(65, 257, device="cuda").bfloat16(), torch.randn(65, device="cuda").bfloat16())]
        opt = qstate.optim.AdamW(ps, lr=1e-2, state_format="8bit", bf16_stochastic_round=True, seed=7,
                                 min_quantize_numel=0)
        for step in range(2):
            for p in ps:
                gen = torch.Generator("cuda").manual_seed(step)
                g = torch.randn(p.shape, device="cuda", generator=gen).bfloat16()
                p.grad = distribute_tensor(g, mesh, [Shard(0)]) if sharded else g
            opt.step()
        runs.append([p.detach().full_tensor() if sharded else p.detach() for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def check_prepared_calls_equal_the_full_path_on_cuda() -> None:
    # later steps reuse each parameter's prepared inductor call (argument views, padded copies refreshed
    # for rows that are not whole blocks, a new stochastic-rounding place each step; without stochastic
    # rounding, the calls run as one batch over concatenated copies): the same bits as steps on the full
    # path, which rebuild every argument (the optimizer loads its own state dict back before each step:
    # new state objects, for which no prepared call is found)
    for fmt, dtype in (("8bit", torch.bfloat16), ("8bit", torch.float32), ("4bit", torch.float32)):
        runs = []
        for reuse in (True, False):
            torch.manual_seed(0)
            ps = [nn.Parameter(torch.randn(s, device="cuda").to(dtype)) for s in ((65, 257), (64, 512), (33, 71))]
            opt = qstate.optim.AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0, bf16_stochastic_round=True,
                                     seed=3)
            for step in range(3):
                for p in ps:
                    gen = torch.Generator("cuda").manual_seed(step)
                    p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
                if not reuse:
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                opt.step()
            runs.append([p.detach() for p in ps] + [t for p in ps for n in ("exp_avg", "exp_avg_sq")
                                                    for t in (opt.state[p][n].codes, opt.state[p][n].scale)])
        for a, b in zip(*runs):
            assert torch.equal(a, b), fmt


def check_cpu_saved_state_loads_on_cuda() -> None:
    q = qstate.quantize(torch.randn(300, 70).abs(), "4bit", signed=False)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True, map_location="cuda")
    assert back.device.type == "cuda" and back.codes.device.type == "cuda"
    assert torch.equal(back.dequantize().cpu(), q.dequantize())


def check_compiled_codec_equals_the_formats_ops_on_cuda() -> None:
    # CUDA states' copy_, quantize and dequantize run inductor's kernels (qstate._compiled_codec)
    from qstate._compiled_codec import COMPILED
    from qstate._state_codec import rows_of
    from qstate.formats import get_format

    for fmt, signed in [("8bit", True), ("8bit", False), ("4bit", True), ("4bit", False), ("fp8", True)]:
        for shape in [(64, 512), (3, 4096)]:
            x = torch.randn(shape, device="cuda") * 10 ** (torch.rand(shape, device="cuda") * 4 - 2)
            x = x if signed else x.abs()
            q = qstate.quantize(x, fmt, signed=signed)
            assert COMPILED.encodes(q, x) and COMPILED.decodes(q), (fmt, signed, shape)
            codes, scale = get_format(fmt).encode(rows_of(x, q.rows, q.row_len), q.block_size, signed, q.qmap)
            assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale), (fmt, signed, shape)
            values = get_format(fmt).decode(q.codes, q.scale, q.row_len, q.block_size, q.qmap).view(shape)
            assert torch.equal(q.dequantize(), values), (fmt, signed, shape)
            q.mul_(0.5)
            codes, scale = get_format(fmt).encode(rows_of(values * 0.5, q.rows, q.row_len), q.block_size, signed,
                                                  q.qmap)
            assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale), (fmt, signed, shape, "mul_")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("cuda_checks: no CUDA device")
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("nccl" if dist.is_nccl_available() else "gloo", rank=0, world_size=1)
    torch.cuda.set_device(0)
    checks = [check_offload_compiled_step_with_cuda_lr, check_grad_scaler_with_offloaded_grads,
              check_compiled_kernels_equal_eager_on_cuda, check_bf16_stochastic_rounding_on_cuda_shards,
              check_prepared_calls_equal_the_full_path_on_cuda, check_cpu_saved_state_loads_on_cuda,
              check_compiled_codec_equals_the_formats_ops_on_cuda]
    failed = []
    try:
        for check in checks:
            try:
                check()
            except Exception:  # report every check: a lent GPU may give one run only
                failed.append(check.__name__)
                print(f"FAIL {check.__name__}\n{traceback.format_exc()}", flush=True)
            else:
                print(f"ok   {check.__name__}", flush=True)
    finally:
        dist.destroy_process_group()
    if failed:
        sys.exit(f"cuda_checks: {len(failed)} of {len(checks)} failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()

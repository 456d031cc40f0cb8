"""Quantized states in real gloo processes: FSDP2 shards, full_tensor, DCP resharding.

Layers have first dims not divisible by the world size (65 x 129, 7 x 16) and
1-D biases, at world sizes 1, 2 and 3.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import torch.nn as nn

from dist_utils import run_distributed

FORMATS = ("8bit", "4bit", "fp8")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(129, 65), nn.ReLU(), nn.Linear(65, 16), nn.ReLU(), nn.Linear(16, 7))


def _values(name: str, shape: torch.Size) -> torch.Tensor:
    """Deterministic state values for parameter ``name`` (same on every rank)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _states(model: nn.Module, fmt: str, signed: bool = True) -> dict:
    """One state per parameter (policy on the global size: small/1-D ones stay fp32), filled."""
    import qstate

    states = {}
    for name, p in model.named_parameters():
        s = qstate.state_like(p, fmt, signed=signed, min_quantize_numel=100)
        full = _values(name, p.shape)
        s.copy_(_distribute_like(full, p))
        states[name] = s
    return states


def _distribute_like(full: torch.Tensor, like) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements)
    return full


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def fsdp_full_tensor_body(rank: int, world_size: int) -> None:
    import qstate
    from torch.distributed.tensor import DTensor

    model = _shard(_model())
    for fmt in FORMATS:
        states = _states(model, fmt)
        for name, s in states.items():
            assert isinstance(s, DTensor), name
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # e.g. "unwaited collective"
                full = s.full_tensor()
            values = _values(name, s.shape)
            if qstate.wants_quantized(s, 100):
                local = s.to_local()
                assert isinstance(local, qstate.QuantizedState) and local.format == fmt
                assert type(full) is qstate.QuantizedState  # never an AsyncCollectiveTensor
                assert type(full.codes) is torch.Tensor and type(full.scale) is torch.Tensor
                ref = qstate.quantize(values, fmt)
                assert torch.equal(full.codes, ref.codes) and torch.equal(full.scale, ref.scale), name
            else:
                assert type(s.to_local()) is torch.Tensor and torch.equal(full, values), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_uneven_states_full_tensor_equals_unsharded(world_size):
    run_distributed(fsdp_full_tensor_body, world_size)


def _template(fmt: str) -> dict:
    model = _shard(_model())
    import qstate

    return {name: qstate.state_like(p, fmt, min_quantize_numel=100) for name, p in model.named_parameters()}


def dcp_save_body(rank: int, world_size: int, path: str, fmt: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"states": _states(_shard(_model()), fmt)}, checkpoint_id=path)


def dcp_load_body(rank: int, world_size: int, path: str, fmt: str) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"states": _template(fmt)}
    dcp.load(sd, checkpoint_id=path)
    _check_loaded(sd, fmt)


def _check_loaded(sd: dict, fmt: str) -> None:
    import qstate

    for name, s in sd["states"].items():
        full = s.full_tensor()
        values = _values(name, s.shape)
        if isinstance(full, qstate.QuantizedState):
            ref = qstate.quantize(values, fmt)
            assert torch.equal(full.codes, ref.codes) and torch.equal(full.scale, ref.scale), name
        else:
            assert torch.equal(full, values), name


def dcp_load_wrong_format_body(rank: int, world_size: int, path: str, fmt: str) -> None:
    import qstate.checkpoint

    sd = {"states": _template(fmt)}
    for s in sd["states"].values():
        s.copy_(_distribute_like(torch.full(s.shape, 0.5), s))
    before = {k: v.full_tensor().dequantize() if hasattr(v.to_local(), "codes") else v.full_tensor()
              for k, v in sd["states"].items()}
    with pytest.raises(ValueError) as info:
        qstate.checkpoint.load(sd, checkpoint_id=path)
    msg = str(info.value)
    assert re.match(r"checkpoint not loaded, states unchanged: 'states\.[\w.]+': expected a "
                    rf"{fmt} signed block_size=128 state \(the destination's\), the checkpoint stores a "
                    r"8bit signed block_size=256 state; loading never converts states$", msg), msg
    after = {k: v.full_tensor().dequantize() if hasattr(v.to_local(), "codes") else v.full_tensor()
             for k, v in sd["states"].items()}
    assert all(torch.equal(before[k], after[k]) for k in before)


def dcp_load_via_qstate_body(rank: int, world_size: int, path: str, fmt: str) -> None:
    import qstate.checkpoint

    sd = {"states": _template(fmt)}
    qstate.checkpoint.load(sd, checkpoint_id=path)
    _check_loaded(sd, fmt)


def uneven_rows_math_body(rank: int, world_size: int) -> None:
    import qstate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.randn(129, 300, generator=torch.Generator().manual_seed(0))
    m = qstate.distributed.quantize_dtensor(distribute_tensor(full, mesh, [Shard(0)]), "8bit")
    # gathering uneven shards pads the short ones with zero rows: the whole state, exactly
    gathered = m.redistribute(mesh, [Replicate()]).to_local()
    want = qstate.quantize(full, "8bit")
    assert torch.equal(gathered.codes, want.codes) and torch.equal(gathered.scale, want.scale)
    # a reduction over dim 0 pads and gathers too, then splits columns (views of the gathered state)
    got = m.mean(dim=0).full_tensor()
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, want.dequantize().mean(dim=0))


def test_math_on_uneven_shards_pads_on_every_rank_and_gives_the_unsharded_result():
    run_distributed(uneven_rows_math_body, 2)


RESHARD = [(2, 1), (2, 3), (3, 2), (1, 2)]


@pytest.mark.parametrize("save_ws,load_ws", [pytest.param(a, b, id=f"{a}to{b}", marks=() if (a, b) == (2, 3) else
                                                            pytest.mark.exhaustive) for a, b in RESHARD])
def test_dcp_checkpoint_reshards_exactly(save_ws, load_ws, tmp_path):
    fmt = FORMATS[(save_ws + load_ws) % 3]
    path = os.fspath(tmp_path / "ckpt")
    run_distributed(dcp_save_body, save_ws, path, fmt)
    run_distributed(dcp_load_body, load_ws, path, fmt)


def test_dcp_load_rejects_another_format(tmp_path):
    path = os.fspath(tmp_path / "ckpt")
    run_distributed(dcp_save_body, 2, path, "8bit")
    run_distributed(dcp_load_wrong_format_body, 3, path, "4bit")
    run_distributed(dcp_load_via_qstate_body, 3, path, "8bit")


def _trained(fmt: str, min_quantize_numel: int = 100, **options):
    import qstate.optim

    model = _shard(_model())
    opt = qstate.optim.AdamW(model.parameters(), lr=1e-2, state_format=fmt, min_quantize_numel=min_quantize_numel,
                             compile=False, **options)
    torch.manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 129)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full_states(opt) -> list:
    out = []
    for st in opt.state.values():
        for k in sorted(st):
            v = st[k]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                f = v.full_tensor()
                out.append(f.dequantize() if hasattr(f, "codes") else f)
    return out


def _roundings(opt) -> list:
    from qstate.distributed import local_of

    return [(k, getattr(local_of(st[k]), "rounding", None)) for st in opt.state.values() for k in sorted(st)]


def optimizer_state_dict_body(rank: int, world_size: int, fmt: str) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    model, opt = _trained(fmt)
    expect = _full_states(opt)
    assert (("exp_avg", "stochastic") in _roundings(opt)) == (fmt == "4bit")
    for full in (True, False):
        options = StateDictOptions(full_state_dict=full)
        sd = get_optimizer_state_dict(model, opt, options=options)
        model2 = _shard(_model())
        import qstate.optim

        opt2 = qstate.optim.AdamW(model2.parameters(), lr=1e-2, state_format=fmt, min_quantize_numel=100,
                                  compile=False)
        set_optimizer_state_dict(model2, opt2, sd, options=options)
        got = _full_states(opt2)
        assert len(got) == len(expect) and all(torch.equal(a, b) for a, b in zip(got, expect)), full
        # every state keeps its rounding (4bit: stochastic first moments) through both paths
        assert _roundings(opt2) == _roundings(opt), (full, _roundings(opt2))
        # the stochastic-rounding stream is (seed, group, step): all of it survives the round trip
        assert [g["seed"] for g in opt2.param_groups] == [g["seed"] for g in opt.param_groups]
        assert all(int(opt2.state[p2]["step"]) == 2 for p2 in model2.parameters())


@pytest.mark.parametrize("world_size,fmt", [(2, "8bit"), (3, "8bit"), (2, "4bit")])
def test_get_set_optimizer_state_dict_full_and_sharded(world_size, fmt):
    run_distributed(optimizer_state_dict_body, world_size, fmt)


def _snapshot(opt) -> tuple:
    """Everything a load could change: full state values, step counts, param groups."""
    steps = [float(st["step"]) for st in opt.state.values()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return _full_states(opt), steps, groups


def _unchanged(opt, before: tuple) -> bool:
    states, steps, groups = _snapshot(opt)
    return (len(states) == len(before[0]) and all(torch.equal(a, b) for a, b in zip(states, before[0]))
            and steps == before[1] and groups == before[2])


def other_policy_state_dict_body(rank: int, world_size: int) -> None:
    import qstate.optim
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    model, opt = _trained("8bit")
    model2, fp32 = _trained("fp32")
    for full in (True, False):
        options = StateDictOptions(full_state_dict=full)
        sd = get_optimizer_state_dict(model, opt, options=options)
        before = _snapshot(fp32)
        with pytest.raises(ValueError) as info:
            set_optimizer_state_dict(model2, fp32, sd, options=options)
        assert re.match(r"AdamW: param 0 \(shape \(65, 129\), torch.float32\), state 'exp_avg': expected a plain "
                        r"torch.float32 state .* got 8bit signed block_size=256", str(info.value)), str(info.value)
        assert _unchanged(fp32, before), full
        # converted, it loads: fp32 states holding the 8bit states' values
        set_optimizer_state_dict(model2, fp32, qstate.optim.convert_state_dict(sd, fp32), options=options)
        got, want = _full_states(fp32), _full_states(opt)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), full
        assert all(type(v.to_local()) is torch.Tensor for st in fp32.state.values() for v in st.values()
                   if v.dim() > 0)


def test_set_optimizer_state_dict_of_another_policy_raises_then_converts():
    run_distributed(other_policy_state_dict_body, 2)


def dcp_save_optimizer_body(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = _trained("8bit")
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    expect = _full_states(opt)
    if rank == 0:
        torch.save(expect, path + ".states")


def dcp_load_optimizer_body(rank: int, world_size: int, path: str) -> None:
    import qstate.checkpoint
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # README's flow: the state dict aliases the live states. An 8bit checkpoint read into fp32 states
    # (which DCP's copy would dequantize), or into 8bit states of another min_quantize_numel, raises
    # with every live state, step and option unchanged
    for fmt, numel, match in [("fp32", 100, r"'optim\.state\.[\w.]+': expected a plain torch.float32 state "
                                            r"\(the destination's\), the checkpoint stores a 8bit signed "
                                            r"block_size=256 state"),
                              ("8bit", 50, r"optim\.param_groups\.0\.min_quantize_numel: expected 50 \(the "
                                           r"optimizer's\), the checkpoint has 100")]:
        model, opt = _trained(fmt, numel)
        before = _snapshot(opt)
        sd = get_optimizer_state_dict(model, opt)
        with pytest.raises(ValueError) as info:
            qstate.checkpoint.load({"optim": sd}, checkpoint_id=path)
        assert re.match(r"checkpoint not loaded, states unchanged: " + match, str(info.value)), str(info.value)
        assert _unchanged(opt, before), fmt
    model, opt = _trained("8bit")
    sd = get_optimizer_state_dict(model, opt)
    qstate.checkpoint.load({"optim": sd}, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, sd)
    got, want = _full_states(opt), torch.load(path + ".states")
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_dcp_checkpoint_of_another_policy_raises_with_live_states_unchanged(tmp_path):
    path = os.fspath(tmp_path / "ckpt")
    run_distributed(dcp_save_optimizer_body, 2, path)
    run_distributed(dcp_load_optimizer_body, 3, path)
    run_distributed(plain_dcp_load_optimizer_body, 3, path)


class _OptimizerState:
    """The ``Stateful`` of DCP's tutorial (and of trainers such as torchtitan): ``dcp.load`` reads into
    its ``state_dict()`` and then calls its ``load_state_dict``."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.opt, state_dict)


def plain_dcp_load_optimizer_body(rank: int, world_size: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # plain dcp.load, no qstate loader: an 8bit checkpoint (block size 256, round to nearest) read into
    # states of another kind raises while DCP reads it (a quantized destination), or in load_state_dict's
    # checks (a plain one, or another policy option), with every live state, step and option unchanged
    kind = r"8bit signed block_size=256 dtype=torch.float32 shape=\(\d+, \d+\) device=cpu"
    for fmt, numel, options, match in [
            ("4bit", 100, {}, r"copy_: expected a state of kind \['state\.\d+\.exp_avg': 4bit signed block_size=128 "
                              rf"rounding=stochastic dtype=torch.float32 shape=\(\d+, \d+\) device=cpu\], got \[{kind}\]; copy_ never "
                              r"converts a state: .* qstate\.optim\.convert_state_dict\(state_dict, optimizer\)"),
            ("8bit", 100, {"block_size": 64}, r"expected a state of kind \['state\.\d+\.exp_avg': 8bit signed "
                                              r"block_size=64 .*got \[8bit signed block_size=256 "),
            ("8bit", 100, {"state_rounding": "stochastic"}, r"expected a state of kind \['state\.\d+\.exp_avg': "
                                                            r"8bit signed block_size=256 rounding=stochastic "),
            ("fp32", 100, {}, r"param group 0, option 'state_format': expected 'fp32' \(the optimizer's\), the "
                              r"state dict has '8bit'; .*qstate\.optim\.convert_state_dict"),
            ("8bit", 50, {}, r"param group 0, option 'min_quantize_numel': expected 50 \(the optimizer's\), the "
                             r"state dict has 100")]:
        model, opt = _trained(fmt, numel, **options)
        before = _snapshot(opt)
        with pytest.raises((CheckpointException, ValueError)) as info:
            dcp.load({"optim": _OptimizerState(model, opt)}, checkpoint_id=path)
        assert re.search(match, str(info.value)), str(info.value)
        assert _unchanged(opt, before), (fmt, numel, options)
        # the state dict's own flow: dcp.load into it, then load_state_dict
        sd = get_optimizer_state_dict(model, opt)
        with pytest.raises((CheckpointException, ValueError)) as info:
            dcp.load({"optim": sd}, checkpoint_id=path)
            set_optimizer_state_dict(model, opt, sd)
        assert re.search(match, str(info.value)), str(info.value)
        assert _unchanged(opt, before), (fmt, numel, options)
    model, opt = _trained("8bit")
    dcp.load({"optim": _OptimizerState(model, opt)}, checkpoint_id=path)
    got, want = _full_states(opt), torch.load(path + ".states")
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))

"""qstate's optimizers in torchtitan, through its own containers and checkpointing.

torchtitan's llama3 debug model (two of its six layers, with torch's SDPA attention in place
of FlexAttention, which has no backward on the CPU) is sharded with FSDP2 ``fully_shard``
per block on 2 and 3 gloo ranks (uneven shards: 2048 rows of the embedding over 3 ranks).
The optimizers come from :class:`qstate.integrations.torchtitan.OptimizersContainer`
(``default_adamw``), the schedule from torchtitan's ``LRSchedulersContainer`` and the
checkpoints from its ``CheckpointManager`` (plain ``dcp.save``/``dcp.load``). For every state
format and every ``implementation`` torchtitan offers, a run that saves after 2 steps and
resumes in new objects equals the uninterrupted 4-step run bit for bit: losses, parameters
and every state (codes and scales). A checkpoint of another state format is refused while
DCP reads it, naming the state, with the optimizer's states unchanged.
"""

from __future__ import annotations

import re

import pytest
import torch

from dist_utils import run_distributed
from trainer_packages import require

require("torchtitan")

FORMATS = ("8bit", "4bit", "fp8")
IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
STEPS, SAVE_AT = 4, 2
BATCH, SEQ = 2, 16


def _model(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = config.build()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


class Run:
    """A model, torchtitan's optimizer and scheduler containers and its checkpoint manager."""

    def __init__(self, world_size: int, folder: str, state_format: str, implementation: str):
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.optimizer import LRSchedulersContainer

        from qstate.integrations.torchtitan import default_adamw

        self.model = _model(world_size)
        config = default_adamw(lr=1e-3, state_format=state_format, min_quantize_numel=1024)
        config.implementation = implementation
        self.optimizers = config.build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                            training_steps=STEPS)
        self.checkpoints = CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVE_AT,
                                                   keep_latest_k=0).build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers, lr_schedulers=self.schedulers,
            states={}, sd_adapter=None, base_folder=folder)

    def train(self, steps: range) -> list[float]:
        losses = []
        for step in steps:
            tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
            logits = self.model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()
            losses.append(loss.item())
        return losses

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer state, whole (quantized states as codes and scales)."""
        out = {f"param {n}": p.detach().full_tensor() for n, p in self.model.named_parameters()}
        (optimizer,) = self.optimizers.optimizers
        names = {p: n for n, p in self.model.named_parameters()}
        for p, state in optimizer.state.items():
            for key, value in state.items():
                full = value.full_tensor() if value.dim() else value
                if hasattr(full, "codes"):
                    out[f"{names[p]} {key} codes"], out[f"{names[p]} {key} scale"] = full.codes, full.scale
                else:
                    out[f"{names[p]} {key}"] = full
        return out


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


def resume_body(rank: int, world_size: int, folder: str) -> None:
    import qstate

    for state_format in FORMATS:
        for implementation in IMPLEMENTATIONS:
            what = f"{state_format}, implementation={implementation!r}, {world_size} ranks"
            path = f"{folder}/{state_format}-{implementation}"
            whole = Run(world_size, path + "-whole", state_format, implementation)
            losses = whole.train(range(STEPS))
            (optimizer,) = whole.optimizers.optimizers
            assert isinstance(optimizer, qstate.optim.AdamW), what
            quantized = sum(isinstance(v.to_local(), qstate.QuantizedState)
                            for st in optimizer.state.values() for v in st.values() if v.dim())
            assert quantized == 2 * sum(p.dim() == 2 for p in whole.model.parameters()) > 0, what

            first = Run(world_size, path, state_format, implementation)
            resumed_losses = first.train(range(SAVE_AT))
            assert first.checkpoints.save(curr_step=SAVE_AT), what
            first.checkpoints.close()
            second = Run(world_size, path, state_format, implementation)
            assert second.checkpoints.load(step=SAVE_AT), what
            resumed_losses += second.train(range(SAVE_AT, STEPS))
            assert resumed_losses == losses, f"{what}: {resumed_losses} != {losses}"
            _assert_equal(second.tensors(), whole.tensors(), what)
            second.checkpoints.close()


def other_format_body(rank: int, world_size: int, folder: str) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    saved = Run(world_size, folder, "8bit", "fused")
    saved.train(range(SAVE_AT))
    assert saved.checkpoints.save(curr_step=SAVE_AT)
    saved.checkpoints.close()
    other = Run(world_size, folder, "4bit", "fused")
    other.train(range(1))
    before = other.tensors()
    with pytest.raises(CheckpointException) as info:
        other.checkpoints.load(step=SAVE_AT)
    assert re.search(r"copy_: expected a state of kind \['state\.[\w.]+\.exp_avg': 4bit signed block_size=128 "
                     r"rounding=stochastic .*\], got \[8bit signed block_size=256 .*\]; .*"
                     r"qstate\.optim\.convert_state_dict", str(info.value)), str(info.value)
    after = other.tensors()
    states = [name for name in before if not name.startswith("param ")]
    _assert_equal({n: after[n] for n in states}, {n: before[n] for n in states}, "the 4bit optimizer's states")
    other.checkpoints.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_save_and_resume_are_bit_exact_for_every_format_and_implementation(world_size, tmp_path):
    run_distributed(resume_body, world_size, str(tmp_path))


def test_a_checkpoint_of_another_format_is_refused_with_the_states_unchanged(tmp_path):
    run_distributed(other_format_body, 2, str(tmp_path))


def test_fused_opt_states_bf16_is_refused_for_qstate_optimizers():
    from qstate.integrations.torchtitan import default_adamw

    config = default_adamw()
    config.implementation = "fused_opt_states_bf16"
    with pytest.raises(ValueError, match=r"implementation='fused_opt_states_bf16' .*\(qstate\.AdamW\).*state_format='bf16'"):
        config.build(model_parts=[torch.nn.Linear(4, 4)])

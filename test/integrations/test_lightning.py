"""qstate's optimizers under Lightning's ``lightning.Trainer`` (the real package, on CPU).

A ``LightningModule`` whose ``configure_optimizers`` returns qstate's AdamW trains,
``trainer.save_checkpoint`` writes the optimizer's ``state_dict()`` (quantized states as
:class:`qstate.QuantizedState`, which ``torch.load(weights_only=True)`` reads after
``import qstate``), and a fresh ``Trainer`` resumed with ``fit(..., ckpt_path=...,
weights_only=True)`` equals the uninterrupted run bit for bit. Under
``precision="bf16-mixed"`` Lightning refuses its own gradient clipping for qstate's
optimizers (which take ``torch.amp.GradScaler``'s scale in their step); a module clips
in ``configure_gradient_clipping`` instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qstate
import qstate.optim

from trainer_packages import require

lightning = require("lightning")

#: every matrix of the model has at least this many elements, so it gets quantized states
MIN_QUANTIZE_NUMEL = 256
BATCH, FEATURES, OUTPUTS = 8, 32, 8
CHECKPOINT_STEP, TOTAL_STEPS = 3, 7


class Regression(lightning.LightningModule):
    """A small MLP (two matrices, biases, a LayerNorm) fitting random targets.

    Step ``k``'s batch is drawn from a generator seeded with ``k``: a resumed fit trains on the
    uninterrupted fit's batches whichever batch of its loader Lightning's restored loops hand it.
    They hand other batches than the uninterrupted fit's: resumed from a checkpoint taken mid-epoch,
    a plain ``DataLoader`` restarts at its first batch; from one that ``save_checkpoint`` wrote after
    ``max_steps`` ended an epoch, the fit runs one more step in the old epoch (on the loader's first
    batch), then starts a new epoch (lightning 2.6, with ``torch.optim.AdamW`` as well)."""

    def __init__(self, state_format: str):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, OUTPUTS))
        self.state_format = state_format
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_index):
        g = torch.Generator().manual_seed(self.trainer.global_step)
        x, y = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUTPUTS, generator=g)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return qstate.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01, state_format=self.state_format,
                                  min_quantize_numel=MIN_QUANTIZE_NUMEL)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(3), batch_size=1)  # the steps' count, not their data


def fit(module: Regression, max_steps: int, ckpt_path=None) -> "lightning.Trainer":
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, enable_progress_bar=False,
                                logger=False, enable_checkpointing=False, enable_model_summary=False)
    # weights_only=True: Lightning reads the checkpoint with torch.load(weights_only=True)
    trainer.fit(module, ckpt_path=None if ckpt_path is None else str(ckpt_path), weights_only=True)
    return trainer


@pytest.mark.parametrize("state_format", ["8bit", "4bit", "fp8"])
def test_resumed_fit_equals_the_uninterrupted_fit(tmp_path, state_format):
    uninterrupted = Regression(state_format)
    fit(uninterrupted, TOTAL_STEPS)
    assert len(uninterrupted.losses) == TOTAL_STEPS

    first = Regression(state_format)
    trainer = fit(first, CHECKPOINT_STEP)
    path = tmp_path / "first.ckpt"
    trainer.save_checkpoint(path)

    checkpoint = torch.load(path, weights_only=True)
    (optimizer_state,) = checkpoint["optimizer_states"]
    matrices = [i for i, p in enumerate(first.parameters()) if p.ndim == 2]
    for i, p in enumerate(first.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            state = optimizer_state["state"][i][name]
            assert isinstance(state, qstate.QuantizedState) == (i in matrices), (i, name)
            if i in matrices:
                assert state.format == state_format
    assert matrices

    resumed = Regression(state_format)
    fit(resumed, TOTAL_STEPS, ckpt_path=path)
    assert len(resumed.losses) == TOTAL_STEPS - CHECKPOINT_STEP
    for got, want in zip(resumed.losses, uninterrupted.losses[CHECKPOINT_STEP:]):
        assert torch.equal(got, want)
    for (name, got), want in zip(resumed.named_parameters(), uninterrupted.parameters()):
        assert torch.equal(got, want), name


class ClippedRegression(Regression):
    """``Regression`` clipping its gradients' norm itself: Lightning's own clipping refuses optimizers that
    unscale gradients in their step (``_step_supports_amp_scaling``, as qstate's and torch's fused ones)
    under mixed precision, bf16 included, where no scaler scales them."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)


def test_bf16_mixed_fit_clips_gradients_in_configure_gradient_clipping():
    def trainer():
        return lightning.Trainer(accelerator="cpu", devices=1, max_steps=4, precision="bf16-mixed",
                                 gradient_clip_val=0.5, enable_progress_bar=False, logger=False,
                                 enable_checkpointing=False, enable_model_summary=False)

    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trainer().fit(Regression("8bit"))
    module = ClippedRegression("8bit")
    trainer().fit(module)

    # the same steps written out: bf16 autocast, the norm clipped, qstate's step
    reference = Regression("8bit")
    optimizer = reference.configure_optimizers()
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, FEATURES, generator=g), torch.randn(BATCH, OUTPUTS, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(reference.net(x), y)
        assert torch.equal(module.losses[step], loss.detach())
        loss.backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    assert len(module.losses) == 4
    for (name, got), want in zip(module.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name

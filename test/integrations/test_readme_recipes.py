"""docs/integrations.md's trainer recipes (the Python blocks after ``<!-- needs: PACKAGE -->``) run as written.

Each package's blocks run in order in one namespace holding what a user of that trainer has at
hand (``torch``, ``qstate``, the package, and for HF ``model``, ``args``, ``train_dataset``), and
what they build is checked: qstate's optimizer, trained, resumed.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
from torch import nn

import qstate
import qstate.optim

from readme_blocks import readme_blocks
from trainer_packages import require

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                       "integrations.md")


def _run_recipes(package: str, namespace: dict, before: Optional[dict[int, dict]] = None) -> dict:
    """Run ``package``'s recipes in order in ``namespace``; ``before[i]`` updates it before recipe ``i``."""
    blocks = [b.code for b in readme_blocks("python", RECIPES) if b.needs == package]
    assert blocks, f"docs/integrations.md has no recipe for {package}"
    namespace = {"__name__": "__readme__", "torch": torch, "qstate": qstate, **namespace}
    for i, code in enumerate(blocks):
        namespace.update((before or {}).get(i, {}))
        exec(compile(code, f"docs/integrations.md {package} recipe {i}", "exec"), namespace)
    return namespace


def _quantized_states(optimizer) -> int:
    return sum(isinstance(v, qstate.QuantizedState) for st in optimizer.state.values() for v in st.values())


def test_hf_trainer_recipes(tmp_path):
    transformers = require("transformers")
    require("accelerate")
    from test_hf_trainer import TokenDataset, tiny_gpt2, training_arguments

    # a checkpoint of torch's AdamW (Trainer's default optimizer) at step 3, for the conversion recipe
    torch_dir = tmp_path / "torch"
    model = tiny_gpt2()
    transformers.Trainer(model=model, args=training_arguments(torch_dir, max_steps=3),
                         train_dataset=TokenDataset(model.config.vocab_size)).train()
    model = tiny_gpt2()
    namespace = _run_recipes("transformers", {
        "transformers": transformers, "model": model, "args": training_arguments(tmp_path / "qstate"),
        "train_dataset": TokenDataset(model.config.vocab_size)},
        before={1: {"args": training_arguments(torch_dir)}})
    trainer = namespace["trainer"]
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around qstate's AdamW
    assert isinstance(optimizer, qstate.optim.AdamW) and _quantized_states(optimizer) > 0
    assert trainer.state.global_step == 5  # resumed from the torch checkpoint's step 3
    converted = torch.load(f"{namespace['checkpoint']}/optimizer.pt", weights_only=True)
    assert any(isinstance(v, qstate.QuantizedState) for st in converted["state"].values() for v in st.values())


def test_lightning_recipe():
    lightning = require("lightning")
    namespace = _run_recipes("lightning", {"lightning": lightning})

    class Module(namespace["LitModel"]):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 1))

        def training_step(self, batch, batch_index):
            return self.net(torch.randn(8, 128)).square().mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(2), batch_size=1)

    module = Module()
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=2, enable_progress_bar=False, logger=False,
                                enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module)
    (optimizer,) = trainer.optimizers
    assert isinstance(optimizer, qstate.optim.AdamW) and _quantized_states(optimizer) == 2


def test_torchtitan_recipe():
    require("torchtitan")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    namespace = _run_recipes("torchtitan", {"config": llama3_debugmodel()})
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 1))
    container = namespace["config"].optimizer.build(model_parts=[model])
    (optimizer,) = container.optimizers
    assert isinstance(optimizer, qstate.optim.AdamW)
    assert optimizer.param_groups[0]["state_format"] == "8bit"
    model(torch.randn(4, 128)).square().mean().backward()
    container.step()
    assert _quantized_states(optimizer) == 2


@pytest.mark.parametrize("package", ["transformers", "lightning", "torchtitan"])
def test_every_trainer_has_a_recipe(package):
    assert [b for b in readme_blocks("python", RECIPES) if b.needs == package]

"""qstate's optimizers under Hugging Face ``transformers.Trainer`` (the real package, on CPU).

A run interrupted at a checkpoint and resumed in a fresh ``Trainer`` with
``trainer.train(resume_from_checkpoint=...)`` equals the uninterrupted run bit for
bit (every parameter and every logged loss), for an optimizer handed over as an
instance (``optimizers=(opt, None)``) or as a class (``optimizer_cls_and_kwargs``):
``Trainer`` saves ``optimizer.state_dict()`` to ``optimizer.pt`` and reloads it with
``torch.load(weights_only=True)`` and ``optimizer.load_state_dict``, which takes the
quantized states as they were. A ``torch.optim.AdamW`` checkpoint resumes under
qstate's AdamW once its ``optimizer.pt`` is rewritten with
:func:`qstate.optim.convert_state_dict` (``load_state_dict`` itself never converts).
"""

from __future__ import annotations

import shutil

import pytest
import torch

import qstate
import qstate.optim

from trainer_packages import require

transformers = require("transformers")
require("accelerate")  # Trainer's dependency

#: tiny GPT-2: every matrix has at least MIN_QUANTIZE_NUMEL elements, so it gets quantized states
MIN_QUANTIZE_NUMEL = 256
BATCH, SEQUENCE, SAMPLES = 4, 16, 8  # 2 steps per epoch: the resumed run (steps 4, 5) crosses an epoch
TOTAL_STEPS, CHECKPOINT_STEP = 5, 3  # the one checkpoint: save_steps=CHECKPOINT_STEP
OPTIMIZER_KWARGS = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01, min_quantize_numel=MIN_QUANTIZE_NUMEL)


class TokenDataset(torch.utils.data.Dataset):
    """Random tokens from a fixed seed; each sample is its own language-modelling target."""

    def __init__(self, vocab_size: int):
        tokens = torch.randint(vocab_size, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(1))
        self.samples = [{"input_ids": t, "labels": t} for t in tokens]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def tiny_gpt2() -> "transformers.GPT2LMHeadModel":
    """The same two-layer GPT-2 on every call (seeded initialization, dropout off)."""
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=SEQUENCE,
                                     bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def training_arguments(output_dir, max_steps: int = TOTAL_STEPS, **overrides) -> "transformers.TrainingArguments":
    args = dict(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=BATCH,
                learning_rate=OPTIMIZER_KWARGS["lr"], weight_decay=OPTIMIZER_KWARGS["weight_decay"],
                logging_steps=1, save_strategy="steps", save_steps=CHECKPOINT_STEP, seed=0, use_cpu=True,
                report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    args.update(overrides)
    return transformers.TrainingArguments(**args)


def make_trainer(output_dir, how: str, state_format: str, **overrides) -> "transformers.Trainer":
    """A Trainer for a fresh tiny GPT-2 whose optimizer is qstate's AdamW, handed over ``how``:
    ``"instance"`` (``optimizers=(opt, None)``) or ``"class"`` (``optimizer_cls_and_kwargs``)."""
    model = tiny_gpt2()
    kwargs = dict(OPTIMIZER_KWARGS, state_format=state_format)
    if how == "instance":
        optimizer = dict(optimizers=(qstate.optim.AdamW(model.parameters(), **kwargs), None))
    else:
        optimizer = dict(optimizer_cls_and_kwargs=(qstate.optim.AdamW, kwargs))
    return transformers.Trainer(model=model, args=training_arguments(output_dir, **overrides),
                                train_dataset=TokenDataset(model.config.vocab_size), **optimizer)


def losses_after(trainer: "transformers.Trainer", step: int) -> dict[int, float]:
    """The loss Trainer logged at each step after ``step`` (``logging_steps=1``: one step's loss, unrounded;
    a resumed Trainer's history holds the checkpoint's steps, then its own)."""
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log and log["step"] > step}


def parameters(trainer: "transformers.Trainer") -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def quantized_state_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> set[str]:
    """The names of the parameters whose states ``optimizer`` keeps quantized."""
    names = {p: n for n, p in model.named_parameters()}
    return {names[p] for p, s in optimizer.state.items()
            if any(isinstance(v, qstate.QuantizedState) for v in s.values())}


def assert_parameters_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for n in expected:
        assert torch.equal(got[n], expected[n]), f"parameter {n} differs"


@pytest.mark.parametrize("how,state_format", [
    ("instance", "8bit"), ("class", "8bit"), ("class", "4bit"), ("class", "fp8"),
])
def test_resumed_run_equals_the_uninterrupted_run(tmp_path, how, state_format):
    uninterrupted = make_trainer(tmp_path / "run", how, state_format)
    uninterrupted.train()
    matrices = {n for n, p in uninterrupted.model.named_parameters() if p.ndim == 2}
    assert quantized_state_names(uninterrupted.optimizer, uninterrupted.model) == matrices
    checkpoint = tmp_path / "run" / f"checkpoint-{CHECKPOINT_STEP}"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert sum(isinstance(v, qstate.QuantizedState) for s in saved["state"].values() for v in s.values()) \
        == 2 * len(matrices)

    resumed = make_trainer(tmp_path / "resumed", how, state_format)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == TOTAL_STEPS
    assert_parameters_equal(parameters(resumed), parameters(uninterrupted))
    expected = losses_after(uninterrupted, CHECKPOINT_STEP)
    assert sorted(expected) == list(range(CHECKPOINT_STEP + 1, TOTAL_STEPS + 1))
    assert losses_after(resumed, CHECKPOINT_STEP) == expected


def scale_per_element(state: qstate.QuantizedState) -> torch.Tensor:
    """Each element's block scale, in the state's shape (a matrix: one row per ``shape[0]``, no padding)."""
    per_row = state.scale.repeat_interleave(state.block_size, dim=1)[:, :state.row_len]
    return per_row.reshape(state.shape)


def assert_converted(converted: torch.Tensor, torch_state: torch.Tensor, name: str) -> None:
    """``converted`` holds ``torch_state``: exactly for a float32 state; for a quantized one, the codes and
    scales ``qstate.quantize`` gives ``torch_state`` in the state's own kind, within the format's bound."""
    if not isinstance(converted, qstate.QuantizedState):
        assert converted.dtype == torch.float32 and torch.equal(converted, torch_state), name
        return
    reference = qstate.quantize(torch_state, converted.format, signed=converted.signed,
                                block_size=converted.block_size, rounding=converted.rounding)
    assert torch.equal(converted.codes, reference.codes), name
    assert torch.equal(converted.scale, reference.scale), name
    fmt = qstate.formats.get_format(converted.format)
    bound = fmt.max_abs_error(torch_state, scale_per_element(converted), converted.signed)
    if converted.rounding == "stochastic":  # the other neighbouring code: up to a whole step
        bound = 2 * bound
    error = (converted.dequantize() - torch_state).abs()
    assert bool((error <= bound).all()), f"{name}: error {float((error - bound).max())} over the bound"


@pytest.fixture(scope="module")
def torch_adamw_checkpoint(tmp_path_factory):
    """A checkpoint of Trainer's own optimizer: ``torch.optim.AdamW`` in its decay and no-decay groups."""
    output_dir = tmp_path_factory.mktemp("torch_adamw")
    trainer = transformers.Trainer(model=tiny_gpt2(), args=training_arguments(output_dir, max_steps=CHECKPOINT_STEP),
                                   train_dataset=TokenDataset(128))
    trainer.train()
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW
    return output_dir / f"checkpoint-{CHECKPOINT_STEP}"


@pytest.mark.parametrize("state_format", ["8bit", "4bit", "fp8"])
def test_torch_adamw_checkpoint_resumes_under_qstate_adamw(tmp_path, torch_adamw_checkpoint, state_format):
    checkpoint = torch_adamw_checkpoint
    torch_state_dict = torch.load(checkpoint / "optimizer.pt", weights_only=True)

    # the user's recipe: qstate's AdamW in Trainer's same groups, the optimizer.pt rewritten for it
    trainer = make_trainer(tmp_path / "qstate", "class", state_format)
    optimizer = trainer.create_optimizer()
    assert [len(g["params"]) for g in optimizer.param_groups] == \
        [len(g["params"]) for g in torch_state_dict["param_groups"]]
    converted = qstate.optim.convert_state_dict(torch_state_dict, optimizer)
    qstate_checkpoint = tmp_path / "converted"
    shutil.copytree(checkpoint, qstate_checkpoint)
    torch.save(converted, qstate_checkpoint / "optimizer.pt")

    for group, torch_group in zip(converted["param_groups"], torch_state_dict["param_groups"]):
        for option in ("lr", "initial_lr", "betas", "eps", "weight_decay"):  # the checkpoint's
            assert group[option] == torch_group[option], option
        assert (group["state_format"], group["min_quantize_numel"]) == (state_format, MIN_QUANTIZE_NUMEL)
    names = [n for g in optimizer.param_groups for p in g["params"]
             for n, q in trainer.model.named_parameters() if q is p]
    quantized = 0
    for i, name in enumerate(names):
        torch_states, states = torch_state_dict["state"][i], converted["state"][i]
        assert states.keys() == torch_states.keys(), name
        assert torch.equal(states["step"], torch_states["step"]), name
        for n in ("exp_avg", "exp_avg_sq"):
            assert_converted(states[n], torch_states[n], f"{name}.{n}")
        quantized += isinstance(states["exp_avg"], qstate.QuantizedState)
    assert quantized == sum(p.ndim == 2 for p in trainer.model.parameters()) > 0

    # load_state_dict keeps the converted states as they are
    optimizer.load_state_dict(torch.load(qstate_checkpoint / "optimizer.pt", weights_only=True))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for n in ("exp_avg", "exp_avg_sq"):
            loaded, want = optimizer.state[p][n], converted["state"][i][n]
            assert type(loaded) is type(want), names[i]
            if isinstance(want, qstate.QuantizedState):
                assert torch.equal(loaded.codes, want.codes) and torch.equal(loaded.scale, want.scale), names[i]
            else:
                assert torch.equal(loaded, want), names[i]

    # Trainer resumes from the rewritten checkpoint with the qstate optimizer it was given
    trainer.train(resume_from_checkpoint=str(qstate_checkpoint))
    assert trainer.state.global_step == TOTAL_STEPS
    assert trainer.optimizer.optimizer is optimizer
    resumed_losses = losses_after(trainer, CHECKPOINT_STEP)
    assert sorted(resumed_losses) == list(range(CHECKPOINT_STEP + 1, TOTAL_STEPS + 1))
    assert all(torch.isfinite(torch.tensor(loss)) for loss in resumed_losses.values())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(s["step"].item() == TOTAL_STEPS for s in optimizer.state.values())

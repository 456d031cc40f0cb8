"""torchtitan's optimizer container with qstate's optimizers selectable by name.

torchtitan builds each optimizer from a name (``ParamGroupConfig.optimizer_name``) out of a
fixed table of ``OptimizersContainer``. :class:`OptimizersContainer` is that container with
qstate's optimizers added under ``"qstate.<class name>"`` (``"qstate.AdamW"``,
``"qstate.Adam"``, ``"qstate.SGD"``, ``"qstate.Lion"``, ``"qstate.AdEMAMix"``); torchtitan's
own names build torch's as before. qstate's keywords (``state_format``, ``block_size``,
``min_quantize_numel``, ...) go in ``optimizer_kwargs`` like the hyperparameters, and
torchtitan's ``implementation`` reaches them as it reaches torch's optimizers (``fused`` and
``foreach`` in every param group): ``"fused"`` runs qstate's fused update, ``"foreach"`` the
same math op by op over each group's list, ``"for-loop"`` tensor by tensor.
``"fused_opt_states_bf16"`` (torch's AdamW with bfloat16 states) is refused for qstate's
optimizers, whose states ``state_format`` chooses (``"bf16"`` among them).

Checkpoints need nothing more: torchtitan's ``CheckpointManager`` saves and loads the
quantized states with ``torch.distributed.checkpoint`` (a checkpoint of another state kind is
refused with the optimizer unchanged: :meth:`qstate.optim.QuantizedOptimizer.state_dict`).

In a trainer config::

    from qstate.integrations.torchtitan import default_adamw

    config.optimizer = default_adamw(lr=8e-4, state_format="8bit")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torchtitan.components.optimizer import OptimizersContainer as TorchtitanOptimizersContainer
from torchtitan.components.optimizer import ParamGroupConfig

from .. import optim

__all__ = ["OPTIMIZERS", "OptimizersContainer", "default_adamw"]

#: the names :class:`OptimizersContainer` builds qstate's optimizers by
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    f"qstate.{cls.__name__}": cls for cls in (optim.AdamW, optim.Adam, optim.SGD, optim.Lion, optim.AdEMAMix)
}


class OptimizersContainer(TorchtitanOptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also builds the optimizers of :data:`OPTIMIZERS`."""

    @dataclass(kw_only=True, slots=True)
    class Config(TorchtitanOptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        qstate_names = sorted({pg.optimizer_name for pg in config.param_groups if pg.optimizer_name in OPTIMIZERS})
        if qstate_names and config.implementation == "fused_opt_states_bf16":
            raise ValueError(f"OptimizersContainer: implementation='fused_opt_states_bf16' makes torch's AdamW keep "
                             f"bfloat16 states; qstate's optimizers ({', '.join(qstate_names)}) keep the states "
                             "their state_format chooses (state_format='bf16' for bfloat16 ones): use "
                             "implementation='fused'")
        super().__init__(config, model_parts=model_parts)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name in OPTIMIZERS:
            return OPTIMIZERS[name]
        return TorchtitanOptimizersContainer._resolve_optimizer_factory(name)


def default_adamw(lr: float = 8e-4, **kwargs: Any) -> OptimizersContainer.Config:
    """torchtitan's ``default_adamw`` (one AdamW group of every parameter: betas ``(0.9, 0.95)``,
    eps ``1e-8``, weight decay ``0.1``) with ``qstate.optim.AdamW``; ``kwargs`` override them and take
    qstate's keywords (``state_format="8bit"``, the default, ``"4bit"``, ``"fp8"``...)."""
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="qstate.AdamW",
                optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **kwargs},
            )
        ]
    )

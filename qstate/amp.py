"""Gradient scaling for sharded, offloaded gradients: :class:`GradScaler`.

qstate's optimizers speak torch's fused-optimizer AMP protocol (``_step_supports_amp_scaling``):
``torch.amp.GradScaler.step`` hands them ``grad_scale`` and ``found_inf`` and they unscale inside
the update, never rewriting the gradient. ``torch.amp.GradScaler`` is enough when every gradient
lives on its mesh's device type (FSDP2 on CPU, or on CUDA without offload).

Use :class:`GradScaler` instead when gradients live on another device than the mesh they are
sharded over (FSDP2 ``CPUOffloadPolicy`` with a CUDA mesh), or one optimizer's gradients live on
several devices, or where you would use ``ShardedGradScaler`` (which all-reduces ``found_inf``
a second time after DTensor did).

Contract: the non-finite check runs per rank on the local gradients (grouped by device and
dtype), then ``found_inf`` is reduced exactly once per mesh dimension of the sharded gradients,
on the mesh's device; plain and replicated gradients are checked locally.
:func:`found_non_finite` runs the same check without a scale (``skip_nonfinite``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

__all__ = ["GradScaler", "found_non_finite"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check works wherever sharded gradients live.

    Same arguments and use as ``torch.amp.GradScaler``; ``device`` is the device
    of the scale (``"cuda"`` or ``"cpu"``), independent of where gradients are.
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool) -> dict[torch.device, Tensor]:
        grads, meshes = _local_grads(optimizer, "GradScaler", allow_fp16)
        return _check_and_unscale(grads, meshes, found_inf, inv_scale)


def found_non_finite(optimizer: torch.optim.Optimizer) -> Tensor:
    """A float32 flag, nonzero iff a gradient of ``optimizer`` holds an inf or a NaN on any rank.

    The check :class:`GradScaler` runs, with a scale of 1 (the gradients keep their bits): one
    read of the local gradients (DTensor gradients: each rank's shards) with
    ``torch._amp_foreach_non_finite_check_and_unscale_`` per device and dtype, then one all-reduce
    (MAX) per mesh dimension of the sharded gradients. The flag lives on the first gradient's
    device (CPU when there are none).
    """
    grads, meshes = _local_grads(optimizer, type(optimizer).__name__, allow_fp16=True)
    device = next(iter(grads), torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float32, device=device)
    found = _check_and_unscale(grads, meshes, zero, torch.ones((), dtype=torch.float32, device=device))
    return torch.stack([f.to(device) for f in found.values()]).amax()


def _local_grads(optimizer: torch.optim.Optimizer, who: str, allow_fp16: bool) -> tuple[dict, list]:
    """``optimizer``'s local gradients by device and dtype (a DTensor's: its shard), and the meshes
    (first seen first, equal ones once) over which a non-replicated gradient is sharded."""
    from torch.distributed.tensor import DTensor

    grads: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
    meshes: dict = {}  # DeviceMesh -> None, in first-seen order (equal meshes count once)
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            what = f"{who}: param {pi} of param group {gi} (shape {tuple(p.shape)})"
            if g.is_sparse:
                hint = "; use torch.amp.GradScaler" if who == "GradScaler" else ""
                raise TypeError(f"{what}: sparse gradients are not supported{hint}")
            if not allow_fp16 and g.dtype == torch.float16:
                raise ValueError(f"{what}: attempting to unscale float16 gradients")
            if isinstance(g, DTensor):
                if not all(pl.is_replicate() for pl in g.placements):
                    meshes.setdefault(g.device_mesh)
                g = g.to_local()  # each rank checks its shard; the reduction below makes it global
            grads[g.device][g.dtype].append(g)
    return grads, list(meshes)


def _check_and_unscale(grads: dict, meshes: list, found_inf: Tensor, inv_scale: Tensor) -> dict[torch.device, Tensor]:
    """Unscale ``grads`` (from :func:`_local_grads`) by ``inv_scale`` and flag non-finite values:
    one flag per device (copies of ``found_inf``), each the max over the ranks of ``meshes``."""
    found: dict[torch.device, Tensor] = {}
    for device, per_dtype in grads.items():
        found[device] = flag = found_inf.to(device, copy=True)
        inv = inv_scale.to(device)
        for same_dtype in per_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, flag, inv)
    if not found:
        found[found_inf.device] = found_inf
    if meshes:
        _reduce_found_inf(found, meshes)
    return found


def _reduce_found_inf(found: dict[torch.device, Tensor], meshes: list) -> None:
    """Make every flag in ``found`` the max over the ranks of ``meshes``: one all-reduce per mesh dim."""
    from torch.distributed.tensor import DTensor, Partial

    flag = None
    for mesh in meshes:
        device = torch.device(mesh.device_type)
        local = torch.stack([f.reshape(()).to(device) for f in found.values()]).amax()
        if flag is not None:
            local = torch.maximum(local, flag.to(device))
        flag = DTensor.from_local(local, mesh, [Partial("max")] * mesh.ndim, run_check=False).full_tensor()
    for f in found.values():
        f.copy_(flag.reshape(f.shape).to(f.device))

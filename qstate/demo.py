"""``python -m qstate.demo``: FSDP2 training with quantized optimizer states, then N -> M resharding.

With no arguments it starts 2 local ranks (gloo on CPU, NCCL when there are
GPUs), shards a small Transformer with FSDP2 (``fully_shard`` per block and at
the root; the vocabulary 101 and feed-forward width 171 make the shards
uneven) and trains it on a deterministic synthetic Markov-chain language twice
with the same data and initialization: once with the reference optimizer
(``torch.optim.AdamW``, fp32 states) and once with ``qstate.optim.AdamW`` and
8-bit states. It prints progress, then a table of optimizer-state bytes per
rank, step time (rank 0's median forward + backward + optimizer step, first
step excluded) and final loss (mean over the last 10 steps and all ranks) for
each run.

It then saves the qstate run's model and optimizer state dicts as a
``torch.distributed.checkpoint`` (DCP) checkpoint, plus a ``torch.save`` of
their full (gathered) values as the reference, and reloads the checkpoint
into a freshly initialized model and optimizer on a different number of
spawned ranks (default: one more) with :func:`qstate.checkpoint.load`. Every
loaded state is gathered (``full_tensor()``) and compared with the reference
exactly: quantized states code for code and scale for scale, plain ones
element for element.

Optimizer-state bytes count ``storage_nbytes()`` of each rank's local
:class:`~qstate.QuantizedState` shards and ``numel * element_size`` of plain
states (moments and step counters).

Run ``python -m qstate.demo --help`` for the options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

import qstate
import qstate.optim
from qstate._demo_model import MarkovText, ModelConfig, TinyTransformer
from qstate.distributed import is_dtensor, local_nbytes
from qstate.launch import default_backend, run_ranks

__all__ = ["main", "parse_args", "DemoConfig", "OPTIMIZERS", "STATE_FORMATS"]

PROG = "python -m qstate.demo"

#: ``--state-format`` values (qstate's quantized formats and the plain ``bf16``/``fp32``)
STATE_FORMATS: tuple[str, ...] = tuple(qstate.optim.STATE_FORMATS())

#: file names inside ``--checkpoint-dir`` next to the DCP files
REFERENCE_FILE = "demo_reference.pt"

#: mismatching entries listed when a reload does not match
MAX_MISMATCHES_SHOWN = 10


@dataclass(frozen=True)
class OptimSpec:
    """An optimizer choice: the qstate class, its fp32 reference in torch (if any) and shared hyper-parameters."""

    qstate_name: str
    torch_name: Optional[str]
    hparams: dict[str, Any]


OPTIMIZERS: dict[str, OptimSpec] = {
    "adamw": OptimSpec("AdamW", "AdamW", dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)),
    "adam": OptimSpec("Adam", "Adam", dict(lr=3e-3, betas=(0.9, 0.95))),
    # torch has no Lion: its reference is qstate's Lion with fp32 states
    "lion": OptimSpec("Lion", None, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
    "sgd": OptimSpec("SGD", "SGD", dict(lr=0.1, momentum=0.9)),
}


@dataclass(frozen=True)
class DemoConfig:
    """Everything the ranks need (picklable, sent to each spawned rank)."""

    optim: str = "adamw"
    state_format: str = "8bit"
    world_size: int = 2
    reload_world_size: int = 3
    steps: int = 200
    log_every: int = 50
    bf16: bool = False
    cpu_offload: bool = False
    backend: str = "gloo"
    batch_size: int = 16
    seed: int = 0
    model: ModelConfig = ModelConfig()


@dataclass(frozen=True)
class Run:
    """One training run: which optimizer class and which state format."""

    label: str
    state_format: str
    use_torch: bool


# ---------------------------------------------------------------- options


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers >= ``minimum``; the error names expected and actual."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """An argparse ``type`` accepting one of ``choices``; the error lists them and the actual value."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def build_parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--optim", type=_one_of(tuple(OPTIMIZERS)), default=defaults.optim,
                   metavar="{" + ",".join(OPTIMIZERS) + "}", help="optimizer of both runs (default: %(default)s)")
    p.add_argument("--state-format", type=_one_of(STATE_FORMATS), default=defaults.state_format,
                   metavar="{" + ",".join(STATE_FORMATS) + "}",
                   help="state format of the qstate run (default: %(default)s)")
    p.add_argument("--world-size", type=_int_at_least(1), default=defaults.world_size, metavar="N",
                   help="ranks to train on (default: %(default)s)")
    p.add_argument("--reload-world-size", type=_int_at_least(1), default=None, metavar="N",
                   help="ranks to reload the checkpoint on (default: world size + 1)")
    p.add_argument("--steps", type=_int_at_least(1), default=defaults.steps, metavar="N",
                   help="training steps per run (default: %(default)s)")
    p.add_argument("--log-every", type=_int_at_least(1), default=defaults.log_every, metavar="N",
                   help="print the mean loss every N steps (default: %(default)s)")
    p.add_argument("--bf16", action="store_true",
                   help="FSDP2 mixed precision: bf16 compute, fp32 parameters and gradient reduction")
    p.add_argument("--cpu-offload", action="store_true",
                   help="FSDP2 CPUOffloadPolicy(pin_memory=False): parameters, gradients and states on the CPU")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where to write the DCP checkpoint (default: a temporary folder, removed at exit)")
    return p


def choose_backend(*world_sizes: int) -> str:
    """NCCL when every rank of every phase can have its own GPU, else gloo (ranks on the CPU)."""
    backend = default_backend()
    if backend == "nccl" and torch.cuda.device_count() < max(world_sizes):
        return "gloo"
    return backend


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[DemoConfig, Optional[str]]:
    """``(config, checkpoint_dir)`` from the command line; exits with an argparse error on bad options."""
    args = build_parser().parse_args(argv)
    reload_ws = args.world_size + 1 if args.reload_world_size is None else args.reload_world_size
    cfg = DemoConfig(optim=args.optim, state_format=args.state_format, world_size=args.world_size,
                     reload_world_size=reload_ws, steps=args.steps, log_every=args.log_every, bf16=args.bf16,
                     cpu_offload=args.cpu_offload, backend=choose_backend(args.world_size, reload_ws))
    return cfg, args.checkpoint_dir


def runs(cfg: DemoConfig) -> list[Run]:
    """The reference run (fp32 states) and the qstate run, in that order."""
    spec = OPTIMIZERS[cfg.optim]
    if spec.torch_name is not None:
        reference = Run(f"torch.optim.{spec.torch_name}", "fp32", use_torch=True)
    else:
        reference = Run(f"qstate.optim.{spec.qstate_name}", "fp32", use_torch=False)
    return [reference, Run(f"qstate.optim.{spec.qstate_name}", cfg.state_format, use_torch=False)]


# ---------------------------------------------------------------- model and optimizer (on a rank)


def _device() -> torch.device:
    """This rank's compute device: its GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def build_model(cfg: DemoConfig, seed: int) -> nn.Module:
    """The Transformer initialized from ``seed``, ``fully_shard``-ed per block and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    device = _device()
    model = TinyTransformer(cfg.model).to(device)
    kwargs: dict[str, Any] = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if cfg.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def build_optimizer(model: nn.Module, cfg: DemoConfig, run: Run) -> torch.optim.Optimizer:
    spec = OPTIMIZERS[cfg.optim]
    if run.use_torch:
        return getattr(torch.optim, spec.torch_name)(model.parameters(), **spec.hparams)
    return getattr(qstate.optim, spec.qstate_name)(model.parameters(), **spec.hparams,
                                                   state_format=run.state_format)


def optimizer_state_nbytes(optim: torch.optim.Optimizer) -> int:
    """Bytes of all tensor states of ``optim`` held by this rank."""
    return sum(local_nbytes(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------- training (on a rank)


def _global_mean(values: torch.Tensor) -> torch.Tensor:
    """Element-wise mean of ``values`` over the ranks."""
    out = values.detach().to(_device(), torch.float64)
    dist.all_reduce(out)
    return out.cpu() / dist.get_world_size()


def _log(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def train(model: nn.Module, optim: torch.optim.Optimizer, cfg: DemoConfig, run: Run) -> dict[str, Any]:
    """Train ``cfg.steps`` steps; ``{"loss": final loss, "step_ms": median step time, "state_bytes": per rank}``."""
    data = MarkovText(cfg.model.vocab, cfg.model.seq_len, seed=cfg.seed)
    device, rank = _device(), dist.get_rank()
    losses, times = torch.zeros(cfg.steps), []
    for step in range(cfg.steps):
        inputs, targets = (t.to(device) for t in data.batch(step, rank, cfg.batch_size))
        start = time.perf_counter()
        loss = model(inputs, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses[step] = loss.item()  # also waits for the device
        times.append(time.perf_counter() - start)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            window = losses[max(0, step + 1 - cfg.log_every): step + 1]
            mean = _global_mean(window).mean().item()
            _log(f"[{run.label} {run.state_format}] step {step + 1:>4}/{cfg.steps}  loss {mean:.4f}  "
                 f"{1e3 * statistics.median(times[-cfg.log_every:]):.1f} ms/step")
    final = _global_mean(losses[-min(10, cfg.steps):]).mean().item()
    per_rank: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(per_rank, optimizer_state_nbytes(optim))
    steady = times[1:] or times  # the first step builds states (and compiles)
    return {"label": run.label, "state_format": run.state_format, "loss": final,
            "step_ms": 1e3 * statistics.median(steady), "state_bytes": per_rank}


# ---------------------------------------------------------------- checkpoint (on a rank)


def _state_dicts(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state dicts keyed by parameter name (live tensors, sharded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf)`` pairs of nested dicts and lists."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        yield prefix, tree
        return
    for key, value in items:
        yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))


def full_values(sd: dict[str, Any]) -> dict[str, Any]:
    """Every leaf of ``sd`` by dotted key, DTensors gathered with ``full_tensor()`` (collective: call on
    all ranks), tensors on the CPU."""
    return {k: _to_cpu(v.full_tensor() if is_dtensor(v) else v) for k, v in _flatten(sd)}


def _layout(q: qstate.QuantizedState) -> tuple:
    return q.format, q.signed, q.block_size, q.rounding, q.row_len, q.dtype, tuple(q.shape)


def _same(a: Any, b: Any) -> bool:
    """Exact equality: quantized states layout, codes, scales and dequantized values; tensors dtype,
    shape and values; anything else ``==``."""
    if isinstance(a, qstate.QuantizedState) or isinstance(b, qstate.QuantizedState):
        return (type(a) is type(b) and _layout(a) == _layout(b) and torch.equal(a.codes, b.codes)
                and torch.equal(a.scale, b.scale) and torch.equal(a.dequantize(), b.dequantize()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def mismatches(loaded: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """Keys whose loaded value differs from the reference (or exists on one side only)."""
    missing = [f"{k}: missing after load" for k in reference.keys() - loaded.keys()]
    extra = [f"{k}: not in the checkpoint" for k in loaded.keys() - reference.keys()]
    differ = [f"{k}: loaded {_describe(loaded[k])} != saved {_describe(reference[k])}"
              for k in sorted(reference.keys() & loaded.keys()) if not _same(loaded[k], reference[k])]
    return sorted(missing) + sorted(extra) + differ


def _describe(value: Any) -> str:
    if isinstance(value, qstate.QuantizedState):
        return value.describe()
    if isinstance(value, torch.Tensor):
        return f"tensor(dtype={value.dtype}, shape={tuple(value.shape)})"
    return repr(value)


def _to_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


def train_body(rank: int, world_size: int, cfg: DemoConfig, ckpt_dir: str, out: str) -> None:
    """Rank body: train every run, checkpoint the last one, rank 0 writes the results to ``out``."""
    import torch.distributed.checkpoint as dcp

    results = []
    for run in runs(cfg):  # same seed and data for both; the last (qstate) run is checkpointed
        model = build_model(cfg, seed=cfg.seed)
        optim = build_optimizer(model, cfg, run)
        results.append(train(model, optim, cfg, run))
    sd = _state_dicts(model, optim)
    dcp.save(sd, checkpoint_id=ckpt_dir)
    reference = full_values(sd)
    if rank == 0:
        torch.save(reference, os.path.join(ckpt_dir, REFERENCE_FILE))
        _write_json(out, {"runs": results, "checkpoint": {"label": run.label, "states": len(reference)}})


def reload_body(rank: int, world_size: int, cfg: DemoConfig, ckpt_dir: str, out: str) -> None:
    """Rank body: load the checkpoint into a fresh model/optimizer, compare with the saved reference."""
    import qstate.checkpoint
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    run = runs(cfg)[-1]
    model = build_model(cfg, seed=cfg.seed + 1)  # another init: loading must overwrite everything
    optim = build_optimizer(model, cfg, run)
    sd = _state_dicts(model, optim)  # also creates the (zero) optimizer states
    qstate.checkpoint.load(sd, checkpoint_id=ckpt_dir)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, optim, sd["optim"])
    # read back from the live model and optimizer
    loaded = full_values(_state_dicts(model, optim))
    if rank == 0:
        reference = torch.load(os.path.join(ckpt_dir, REFERENCE_FILE), weights_only=True)
        quantized = sorted({v.format for v in loaded.values() if isinstance(v, qstate.QuantizedState)})
        _write_json(out, {"compared": len(reference), "mismatches": mismatches(loaded, reference),
                          "quantized": sum(isinstance(v, qstate.QuantizedState) for v in loaded.values()),
                          "formats": quantized})


# ---------------------------------------------------------------- driver (parent process)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


class RankFailure(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def _spawn(fn: Callable[..., None], world_size: int, cfg: DemoConfig, ckpt_dir: str) -> dict[str, Any]:
    """Run ``fn(rank, world_size, cfg, ckpt_dir, out)`` on spawned ranks; return what rank 0 wrote to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            run_ranks(fn, world_size, cfg, ckpt_dir, out, backend=cfg.backend)
        except RuntimeError as e:
            raise RankFailure(f"{fn.__name__} failed on {world_size} ranks:\n{e}") from None
        with open(out) as f:
            return json.load(f)


@contextlib.contextmanager
def _checkpoint_dir(path: Optional[str]) -> Iterator[str]:
    if path is not None:
        os.makedirs(path, exist_ok=True)
        yield os.path.abspath(path)
    else:
        with tempfile.TemporaryDirectory(prefix="qstate_demo_") as tmp:
            yield tmp


def format_table(results: list[dict[str, Any]]) -> str:
    """The results table: state bytes per rank, their total relative to the first run, step time, final loss."""
    base = sum(results[0]["state_bytes"])
    rows = [("run", "states", "state bytes per rank", "vs ref", "step ms", "final loss")]
    for r in results:
        rows.append((r["label"], r["state_format"], " / ".join(f"{b:,}" for b in r["state_bytes"]),
                     f"{sum(r['state_bytes']) / base:.3f}", f"{r['step_ms']:.1f}", f"{r['loss']:.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [row[0].ljust(widths[0]) + "".join("  " + c.rjust(w) for c, w in zip(row[1:], widths[1:]))
             for row in rows]
    return "\n".join(lines)


def _describe_setup(cfg: DemoConfig) -> str:
    data = MarkovText(cfg.model.vocab, cfg.model.seq_len, seed=cfg.seed)
    n_params = sum(p.numel() for p in TinyTransformer(cfg.model).parameters())
    extras = "".join(f", {name}" for name, on in (("bf16 compute", cfg.bf16), ("cpu offload", cfg.cpu_offload)) if on)
    return (f"qstate {qstate.__version__}, torch {torch.__version__}: FSDP2 on {_ranks(cfg.world_size)} "
            f"({cfg.backend}{extras}); {n_params:,}-parameter Transformer, {cfg.steps} steps of batch "
            f"{cfg.batch_size}x{cfg.model.seq_len} per rank (best possible loss {data.entropy_rate():.4f})")


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def demo(cfg: DemoConfig, checkpoint_dir: Optional[str]) -> int:
    """Train, print the table, checkpoint, reload at ``cfg.reload_world_size``; 0 if the states match."""
    print(_describe_setup(cfg), flush=True)
    with _checkpoint_dir(checkpoint_dir) as ckpt:
        trained = _spawn(train_body, cfg.world_size, cfg, ckpt)
        print(format_table(trained["runs"]))
        saved = trained["checkpoint"]
        print(f"saved a DCP checkpoint of the {saved['label']} run ({saved['states']} model and optimizer "
              f"entries) on {_ranks(cfg.world_size)} to {ckpt}", flush=True)
        check = _spawn(reload_body, cfg.reload_world_size, cfg, ckpt)
    where = f"reloaded on {_ranks(cfg.reload_world_size)}"
    bad = check["mismatches"]
    if bad:
        shown = bad[:MAX_MISMATCHES_SHOWN] + ([f"... and {len(bad) - MAX_MISMATCHES_SHOWN} more"]
                                              if len(bad) > MAX_MISMATCHES_SHOWN else [])
        print(f"{where}: {len(bad)} of {check['compared']} entries DO NOT match the checkpoint saved on "
              f"{_ranks(cfg.world_size)}:\n" + "\n".join(f"  {m}" for m in shown), file=sys.stderr)
        return 1
    how = (f"{check['quantized']} quantized {'/'.join(check['formats'])} states code for code"
           if check["quantized"] else "all states plain, element for element")
    print(f"{where}: states match the checkpoint saved on {_ranks(cfg.world_size)} exactly "
          f"({check['compared']} entries compared, {how})")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg, checkpoint_dir = parse_args(argv)
    try:
        return demo(cfg, checkpoint_dir)
    except RankFailure as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

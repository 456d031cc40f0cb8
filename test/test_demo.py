"""``python -m qstate.demo``: end to end with tiny settings, option errors, rank failures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import qstate
import qstate.demo
from qstate.demo import DemoConfig, RankFailure, main, mismatches, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(label: str, fmt: str, ranks: int) -> re.Pattern:
    """A table row: label, format, one byte count per rank, ratio, step ms, final loss."""
    per_rank = r" / ".join([r"([\d,]+)"] * ranks)
    return re.compile(rf"^{re.escape(label)}\s+{fmt}\s+{per_rank}\s+([\d.]+)\s+[\d.]+\s+([\d.]+)$", re.M)


def _bytes(match: re.Match, ranks: int) -> list[int]:
    return [int(match.group(i + 1).replace(",", "")) for i in range(ranks)]


def test_demo_end_to_end_tiny(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "qstate.demo", "--steps", "3", "--log-every", "2", "--world-size", "2",
           "--reload-world-size", "3", "--checkpoint-dir", os.fspath(ckpt)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=170,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "FSDP2 on 2 ranks" in out
    for label in ("torch.optim.AdamW fp32", "qstate.optim.AdamW 8bit"):
        assert f"[{label}] step    2/3  loss" in out and f"[{label}] step    3/3  loss" in out, out
    assert re.search(r"^run\s+states\s+state bytes per rank\s+vs ref\s+step ms\s+final loss$", out, re.M), out
    ref, q8 = _row("torch.optim.AdamW", "fp32", 2).search(out), _row("qstate.optim.AdamW", "8bit", 2).search(out)
    assert ref and q8, out
    # fp32 Adam: 2 states x 4 bytes per element, + a step counter per parameter
    assert sum(_bytes(ref, 2)) >= 8 * 93_243 and ref.group(3) == "1.000"
    assert sum(_bytes(q8, 2)) < 0.4 * sum(_bytes(ref, 2)) and float(q8.group(3)) < 0.4
    assert "saved a DCP checkpoint of the qstate.optim.AdamW run" in out and "on 2 ranks to" in out
    assert re.search(r"^reloaded on 3 ranks: states match the checkpoint saved on 2 ranks exactly "
                     r"\(\d+ entries compared, \d+ quantized 8bit states code for code\)$", out, re.M), out
    assert (ckpt / ".metadata").is_file() and (ckpt / qstate.demo.REFERENCE_FILE).is_file()


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


BAD_OPTIONS = [
    (["--world-size", "0"], "argument --world-size: expected an integer >= 1, got '0'"),
    (["--world-size", "two"], "argument --world-size: expected an integer >= 1, got 'two'"),
    (["--reload-world-size", "-1"], "argument --reload-world-size: expected an integer >= 1, got '-1'"),
    (["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    (["--state-format", "int3"],
     "argument --state-format: expected one of 4bit, 8bit, bf16, fp32, fp8, got 'int3'"),
    (["--optim", "rmsprop"], "argument --optim: expected one of adamw, adam, lion, sgd, got 'rmsprop'"),
]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_option_is_an_argparse_error(capsys, argv, message):
    assert _usage_error(capsys, argv) == f"python -m qstate.demo: error: {message}"


def test_defaults():
    cfg, ckpt = parse_args([])
    assert (cfg.optim, cfg.state_format, cfg.world_size, cfg.reload_world_size) == ("adamw", "8bit", 2, 3)
    assert ckpt is None and not cfg.bf16 and not cfg.cpu_offload
    assert parse_args(["--world-size", "3"])[0].reload_world_size == 4


def test_mismatches_compares_exactly():
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(0))
    saved = {"optim.state.w.exp_avg": qstate.quantize(x, "8bit"), "optim.state.b.step": torch.tensor(3.0),
             "optim.param_groups.0.lr": 0.001}
    assert mismatches(dict(saved), saved) == []
    loaded = {"optim.state.w.exp_avg": qstate.quantize(x.clone().index_fill_(0, torch.tensor([8]), 0.0), "8bit"),
              "optim.state.b.step": torch.tensor(3.0, dtype=torch.float64), "model.extra": 1}
    assert mismatches(loaded, saved) == [
        "optim.param_groups.0.lr: missing after load",
        "model.extra: not in the checkpoint",
        "optim.state.b.step: loaded tensor(dtype=torch.float64, shape=()) != saved tensor(dtype=torch.float32, shape=())",
        "optim.state.w.exp_avg: loaded 8bit signed block_size=256 dtype=torch.float32 shape=(9, 300) device=cpu "
        "!= saved 8bit signed block_size=256 dtype=torch.float32 shape=(9, 300) device=cpu",
    ]


def failing_body(rank: int, world_size: int, cfg: DemoConfig, ckpt_dir: str, out: str) -> None:
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")


def test_rank_failure_carries_the_traceback(monkeypatch, tmp_path):
    # the demo's training run, with a body that fails on rank 1
    monkeypatch.setattr(qstate.demo, "train_body", failing_body)
    with pytest.raises(RankFailure) as info:
        qstate.demo.demo(DemoConfig(), os.fspath(tmp_path))
    msg = str(info.value)
    assert msg.startswith("failing_body failed on 2 ranks:\n"), msg
    assert "Traceback (most recent call last)" in msg and "ValueError: boom on rank 1" in msg, msg


def test_main_exits_nonzero_on_rank_failure(monkeypatch, capsys):
    def fail(cfg, checkpoint_dir):
        raise RankFailure("train_body failed on 2 ranks:\nTraceback ...\nValueError: boom")

    monkeypatch.setattr(qstate.demo, "demo", fail)
    assert main(["--steps", "1"]) == 1
    assert capsys.readouterr().err == ("python -m qstate.demo: train_body failed on 2 ranks:\n"
                                       "Traceback ...\nValueError: boom\n")

"""The engine's backends: the C kernel is one folder and one registration.

Deleting ``qstate/optim/_engine/cpu/`` and its import in ``_engine/__init__.py`` leaves an engine that
runs on CPU as ``cpu_kernel_enabled(False)`` does (inductor's kernels, whose results are the C
kernel's bit for bit; small plain states the math op by op), shown on a copy of the package in a
subprocess. Private: the folder and the import are the engine's layout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import qstate
from qstate.optim import AdamW, cpu_kernel_enabled

#: a few steps of an 8bit and an fp32-state AdamW over a weight and a bias, saved to ``argv[1]``
_STEPS = """
import sys
import torch
import qstate
from qstate.optim import AdamW

def run(fmt):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(33, 300, generator=g)), torch.nn.Parameter(torch.randn(300, generator=g))]
    opt = AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0, seed=1)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in ps] + [qstate.dequantize(v) for s in opt.state.values() for k, v in s.items()
                                       if k != "step"]

assert ("qstate.optim._engine.cpu" in sys.modules) == (sys.argv[2] == "off"), qstate.__file__
with qstate.optim.cpu_kernel_enabled(False):
    torch.save([run("8bit"), run("fp32")], sys.argv[1])
"""


def _run_steps(package_root: Path, out: Path, which: str) -> list:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    # run from the output's folder: ``-c`` puts the working directory first on sys.path
    proc = subprocess.run([sys.executable, "-c", _STEPS, str(out), which], env=env, capture_output=True, text=True,
                          timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_the_engine_without_the_c_kernel_folder_runs_as_with_the_c_kernel_switched_off(tmp_path):
    copy = tmp_path / "qstate"
    shutil.copytree(Path(qstate.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(copy / "optim" / "_engine" / "cpu")
    init = copy / "optim" / "_engine" / "__init__.py"
    lines = init.read_text().splitlines(keepends=True)
    registration = [line for line in lines if line.startswith("from . import cpu")]
    assert len(registration) == 1, "the C kernel is not one import in _engine/__init__.py"
    init.write_text("".join(line for line in lines if line not in registration))

    (tmp_path / "out").mkdir()
    without = _run_steps(tmp_path, tmp_path / "out" / "without.pt", "without")
    switched_off = _run_steps(Path(qstate.__file__).parent.parent, tmp_path / "out" / "off.pt", "off")
    for fmt_without, fmt_with in zip(without, switched_off):
        for a, b in zip(fmt_without, fmt_with):
            assert torch.equal(a, b)


def test_a_switched_off_c_kernel_leaves_its_prepared_calls_unused(monkeypatch):
    # a prepared C call is valid only under the backends' switch it was built under: turning the C kernel off
    # runs inductor's kernel (the same bits), turning it on again the C kernel
    from qstate.optim._engine.cpu import kernel as c_kernel

    c_calls = []
    call = c_kernel.PreparedCall.__call__
    monkeypatch.setattr(c_kernel.PreparedCall, "__call__", lambda self, *a, **k: c_calls.append(1) or call(self, *a, **k))

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(17, 256, generator=g))
    ref = torch.nn.Parameter(p.detach().clone())
    opt, ref_opt = (AdamW([x], lr=1e-2, state_format="8bit", min_quantize_numel=0, seed=1) for x in (p, ref))
    for step in range(4):
        grad = torch.randn(p.shape, generator=g)
        p.grad, ref.grad = grad.clone(), grad.clone()
        with cpu_kernel_enabled(False):
            ref_opt.step()
        before = len(c_calls)
        with cpu_kernel_enabled(step != 2):
            opt.step()
        assert len(c_calls) - before == (0 if step == 2 else 1)
        assert torch.equal(p, ref)


def test_the_op_refuses_a_scalar_vector_of_another_length_before_writing():
    # the kernels read one scalar per name of the rule: a shorter vector would be read past its end
    from qstate.optim._engine.op import UpdateVariant

    flags = (("amsgrad", False), ("decoupled", True), ("maximize", False))
    p, g = torch.randn(4, 256), torch.randn(4, 256)
    m, v = qstate.zeros_like(p, "8bit", signed=True), qstate.zeros_like(p, "8bit", signed=False)
    before = [t.clone() for t in (p, m.codes, m.scale, v.codes, v.scale)]
    for eager in (False, True):
        variant = UpdateVariant("adam", flags, False, eager).name
        for hyper in (torch.zeros(8), torch.zeros(9, 1), torch.zeros(9, dtype=torch.int64)):
            try:
                torch.ops.qstate.fused_update([p], [g], [m, v], hyper, variant)
            except ValueError as error:
                assert "expected hyper to be a floating-point vector of the 9 scalars of 'adam'" in str(error)
            else:
                raise AssertionError(f"no error for hyper of shape {tuple(hyper.shape)}, {hyper.dtype}")
    for a, b in zip(before, (p, m.codes, m.scale, v.codes, v.scale)):
        assert torch.equal(a, b)

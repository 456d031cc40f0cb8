"""Every Python block of README.md runs, in order, in one namespace, as a user would paste them."""

from __future__ import annotations

import os
import re

import torch

import qstate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_blocks(lang: str) -> list[str]:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)


def test_readme_python_blocks_run(capsys):
    blocks = _readme_blocks("python")
    assert len(blocks) >= 2
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    opt, ref = namespace["opt"], namespace["ref"]
    # the converted torch AdamW states: 8-bit where the policy quantizes, equal to torch's within the format
    weight = namespace["model"][0].weight
    exp_avg = opt.state[weight]["exp_avg"]
    assert isinstance(exp_avg, qstate.QuantizedState) and exp_avg.format == "8bit"
    torch.testing.assert_close(exp_avg.dequantize(), ref.state[weight]["exp_avg"], atol=0.01 * float(
        ref.state[weight]["exp_avg"].abs().max()), rtol=0)
    assert int(opt.state[weight]["step"]) == 1


def test_readme_commands_are_the_ci_commands():
    # .ci/run takes the test command from between these markers; the demo command is what test_demo runs
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    for marker in ("test-command", "demo-command"):
        assert re.search(rf"<!-- {marker} -->\n```bash\n.+\n```\n<!-- /{marker} -->", text), marker
    assert "python -m qstate.demo" in text

"""Every Python block of README.md runs, in order, in one namespace, as a user would paste them (the
trainers' recipes, in docs/integrations.md, run in ``test/integrations/test_readme_recipes.py``)."""

from __future__ import annotations

import re

import torch

import qstate
from readme_blocks import readme_blocks, readme_text


def test_readme_python_blocks_run(capsys):
    blocks = [b.code for b in readme_blocks("python") if b.needs is None]
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
    text = readme_text()
    for marker in ("test-command", "demo-command", "exhaustive-command", "integrations-command"):
        assert re.search(rf"<!-- {marker} -->\n```bash\n.+\n```\n<!-- /{marker} -->", text), marker
    assert "python -m qstate.demo" in text

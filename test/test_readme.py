"""Every Python block of README.md runs, in order, in one namespace, as a user would paste them."""

from __future__ import annotations

import os
import re

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
    opt = namespace["opt"]
    assert opt.state_dict()["state"], "the quick start's optimizer has no state after its steps"


def test_readme_commands_are_the_ci_commands():
    # .ci/run takes the test command from between these markers; the demo command is what test_demo runs
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    for marker in ("test-command", "demo-command"):
        assert re.search(rf"<!-- {marker} -->\n```bash\n.+\n```\n<!-- /{marker} -->", text), marker
    assert "python -m qstate.demo" in text

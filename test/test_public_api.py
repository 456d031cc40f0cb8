"""The public names are a promise to users: these tests keep them and their enumerations true."""

from __future__ import annotations

import inspect
import pathlib

import qstate
import qstate.optim
from qstate.optim._policy_optimizer import PolicyOptimizer

ROOT = pathlib.Path(qstate.__file__).resolve().parent.parent


def test_qstate_optim_exports_what_users_and_rule_authors_need():
    # the optimizers, functional, the base class, a rule's building blocks, conversion, the kernel
    # switch, bf16 stochastic rounding and Adam's bounds; kernel internals stay private
    assert sorted(qstate.optim.__all__) == sorted([
        "AdamW", "Adam", "AdEMAMix", "Lion", "SGD", "Muon", "QuantizedOptimizer", "functional", "STATE_FORMATS",
        "convert_state_dict", "cpu_kernel_enabled", "stochastic_round_bf16", "adam_bound", "adam_update_bound",
        "StateSpec", "UpdateRule", "register_rule", "StatePolicy"])
    for name in qstate.optim.__all__:
        assert hasattr(qstate.optim, name), name


def test_every_exported_optimizer_is_documented():
    optimizers = [name for name in qstate.optim.__all__ if inspect.isclass(getattr(qstate.optim, name))
                  and issubclass(getattr(qstate.optim, name), PolicyOptimizer)
                  and name != "QuantizedOptimizer"]
    assert "Muon" in optimizers
    readme = (ROOT / "README.md").read_text()
    for name in optimizers:
        assert f"`{name}`" in readme or f"optim.{name}" in readme, f"README.md does not name {name}"
        assert f"``{name}``" in qstate.optim.__doc__, f"qstate.optim's docstring does not name {name}"
        assert getattr(qstate.optim, name).__doc__, f"{name} has no docstring"


def test_no_retired_word_remains():
    retired = ["kernel kind"]
    found = [f"{path.relative_to(ROOT)}: {word!r}"
             for path in [*ROOT.joinpath("qstate").rglob("*.py"), *ROOT.joinpath("qstate").rglob("*.c"),
                          ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.joinpath("docs").glob("*.md")]
             for word in retired if word in path.read_text().lower()]
    assert found == []

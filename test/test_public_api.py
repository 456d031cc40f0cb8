"""The public names are a promise to users: this test pins them (test_docs_contract.py keeps their
documentation true)."""

from __future__ import annotations

import qstate
import qstate.optim


def test_qstate_optim_exports_what_users_and_rule_authors_need():
    # the optimizers, functional, the base class, a rule's building blocks, conversion, the kernel
    # switch, bf16 stochastic rounding and Adam's bounds; kernel internals stay private
    assert sorted(qstate.optim.__all__) == sorted([
        "AdamW", "Adam", "AdEMAMix", "Lion", "SGD", "Muon", "QuantizedOptimizer", "functional", "STATE_FORMATS",
        "convert_state_dict", "cpu_kernel_enabled", "stochastic_round_bf16", "adam_bound", "adam_update_bound",
        "StateSpec", "UpdateRule", "register_rule", "StatePolicy"])
    for name in qstate.optim.__all__:
        assert hasattr(qstate.optim, name), name


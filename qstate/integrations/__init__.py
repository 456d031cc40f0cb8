"""qstate's optimizers in trainers that build optimizers themselves.

One module per trainer, imported by name (``import qstate.integrations.torchtitan``); each
needs its trainer installed (``pip install "qstate[integrations]"``) and ``import qstate``
imports none of them. HF ``Trainer`` and Lightning take qstate's optimizers as they are
(docs/integrations.md).
"""

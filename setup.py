from setuptools import find_packages, setup

setup(
    name="qstate",
    version="0.1.0",
    description=(
        "Quantized (8-bit, 4-bit, FP8) optimizer state as tensor subclasses "
        "that DTensor and FSDP2 run natively"
    ),
    packages=find_packages(include=["qstate", "qstate.*"]),
    # the C kernel's source, compiled on first use (qstate/optim/_engine/cpu/kernel.py)
    package_data={"qstate.optim._engine.cpu": ["csrc/*.c"]},
    python_requires=">=3.10",
    # the oldest torch CI tests (.ci/run runs the suite on it and on the newest pip resolves)
    install_requires=["torch>=2.13.0"],
    extras_require={
        "test": ["pytest", "hypothesis", "expecttest", "scikit-learn"],
        "bench": ["matplotlib"],
        # the demo's multi-rank steps that pass Python objects (torch.distributed's *_object
        # collectives, which torch.distributed.checkpoint's save uses) need numpy, which torch's
        # wheel does not install
        "demo": ["numpy"],
        # the trainers test/integrations/ runs qstate's optimizers in (torchtitan needs Python 3.11 and
        # imports triton, which torch's CPU wheels do not install)
        "integrations": [
            "transformers",
            "accelerate",
            "lightning",
            "torchtitan; python_version >= '3.11'",
            "triton; python_version >= '3.11' and platform_system == 'Linux'",
            # optimizer libraries stepping on qstate's states (test/integrations/test_optimizer_libraries.py)
            "heavyball",
            "pytorch-optimizer",
        ],
    },
)

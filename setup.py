"""tflms: large model support (activation swapping) for TensorFlow 2 training steps.

TensorFlow is pinned to 2.21, as the ``tensorflow`` package: the one that KerasHub,
tensorflow-text, tf-keras and the rest of the ecosystem depend on, so that installing them
beside tflms adds no second TensorFlow. Where an NVIDIA driver is present (``nvidia-smi`` on
PATH) its CUDA libraries come with it (``tensorflow[and-cuda]``). Override with
``TFLMS_TF=cpu`` or ``TFLMS_TF=gpu`` (or ``TFLMS_TF=none`` to manage TensorFlow yourself).
"""

import os
import shutil

from setuptools import find_packages, setup

TF_VERSION = "2.21.*"


def tensorflow_requirement() -> list[str]:
    choice = os.environ.get("TFLMS_TF", "auto").lower()
    if choice not in {"auto", "cpu", "gpu", "none"}:
        raise SystemExit(f"TFLMS_TF must be auto, cpu, gpu or none. Received: TFLMS_TF={choice!r}")
    if choice == "auto":
        choice = "gpu" if shutil.which("nvidia-smi") else "cpu"
    return {
        "cpu": [f"tensorflow=={TF_VERSION}"],
        "gpu": [f"tensorflow[and-cuda]=={TF_VERSION}"],
        "none": [],
    }[choice]


setup(
    name="tflms",
    version="0.1.0",
    description="Train TensorFlow models larger than GPU memory: graph-level activation swapping for TF 2",
    long_description=open(os.path.join(os.path.dirname(__file__), "README.md"), encoding="utf-8").read()
    if os.path.exists(os.path.join(os.path.dirname(__file__), "README.md"))
    else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["tflms", "tflms.*"]),
    install_requires=tensorflow_requirement() + ["lazy-loader>=0.4", "networkx>=3.2", "numpy>=1.26"],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.6",
            "ruff>=0.6",
            "matplotlib>=3.8",
            "nbclient>=0.10",
            "nbformat>=5.9",
            "ipykernel>=6.29",
            # The ecosystem's models (tests/ecosystem): KerasHub tasks built from configs, tf-keras.
            "keras-hub==0.32.*",
            f"tf-keras=={TF_VERSION}",
        ],
        "plot": ["matplotlib>=3.8"],
        "docs": [
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
            "mkdocstrings[python]>=0.26",
        ],
    },
    entry_points={"console_scripts": ["tflms=tflms.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

from setuptools import find_packages, setup

setup(
    name="rayflow",
    version="0.1.0",
    description="Ray-native online RL (FlowGRPO, DiffusionNFT) for flow-matching text-to-image models",
    packages=find_packages(include=["rayflow", "rayflow.*"]),
    python_requires=">=3.10",
    install_requires=[
        "ray[default]>=2.60",
        "torch>=2.6",
        "diffusers>=0.42",
        "peft>=0.17",
        "transformers>=5.0",
        "tokenizers",
        "omegaconf>=2.3",
        "tensorboard",
        "safetensors",
        "pillow",
        "tqdm",
        "numpy",
        # The `ocr` reward: PP-OCRv4 det/rec ONNX models inside the wheel (the package supports Python < 3.13).
        "rapidocr-onnxruntime>=1.4,<1.5; python_version < '3.13'",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "requests", "pyyaml", "jsonschema", "wandb", "matplotlib"],
        "wandb": ["wandb"],
        "plot": ["matplotlib"],  # tools/plot_run.py
    },
)

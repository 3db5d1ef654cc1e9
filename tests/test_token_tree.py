"""A batch as one token tree: the layout (each distinct run of leading tokens once, each node seeing
the shared prefix and its own ancestors at its own position), and the embedded engine scoring and
generating through it exactly as through padded batches and as each prompt alone."""
import math
import random
import warnings

import pytest
import torch

from torchrl_oni.serve._token_tree import token_tree


def _ancestor_mask(tree, prefix_len):
    """The mask rebuilt from each prompt's columns alone: a node sees the prefix, the nodes before
    it on a prompt's path, and itself."""
    rows, width = tree.input_ids.shape
    want = torch.zeros((rows, 1, width, prefix_len + width), dtype=torch.bool)
    want[..., :prefix_len] = True
    for r in range(rows):
        for c in range(width):
            want[r, 0, c, prefix_len + c] = True
    for (row, _), cols in zip(tree.last.tolist(), tree.columns):
        for j, c in enumerate(cols):
            for a in cols[:j]:
                want[row, 0, c, prefix_len + a] = True
    return want


def test_common_beginnings_run_once_at_their_positions():
    suffixes = [[1, 2, 3], [1, 2, 4, 5], [1, 2, 3], [7], [1, 9]]
    tree = token_tree(suffixes, prefix_len=10, pad_id=0)
    distinct = {tuple(s[:k]) for s in suffixes for k in range(1, len(s) + 1)}
    assert tree.nodes == len(distinct) == 7 and tree.input_ids.shape == (1, 7)
    for suffix, cols, (row, last) in zip(suffixes, tree.columns, tree.last.tolist()):
        assert tree.input_ids[row, cols].tolist() == suffix
        assert tree.position_ids[row, cols].tolist() == list(range(10, 10 + len(suffix)))
        assert last == cols[-1]
    assert tree.columns[0] == tree.columns[2]  # the same prompt twice: one path
    assert torch.equal(tree.mask, _ancestor_mask(tree, 10))


def test_random_batches_match_the_mask_built_from_each_prompt_alone():
    rng = random.Random(0)
    for _ in range(20):
        suffixes = [[rng.choice([3, 4, 5]) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 12))]
        prefix_len = rng.randint(0, 4)
        tree = token_tree(suffixes, prefix_len=prefix_len, pad_id=99, row_tokens=rng.randint(1, 20))
        assert torch.equal(tree.mask, _ancestor_mask(tree, prefix_len))
        for suffix, cols, row in zip(suffixes, tree.columns, tree.rows):
            assert tree.input_ids[row, cols].tolist() == suffix
        used = {(row, c) for cols, row in zip(tree.columns, tree.rows) for c in cols}
        pads = [(r, c) for r in range(tree.input_ids.shape[0]) for c in range(tree.input_ids.shape[1])
                if (r, c) not in used]
        assert all(tree.input_ids[r, c] == 99 and tree.position_ids[r, c] == prefix_len for r, c in pads)
        assert tree.nodes == len(used)


def test_rows_close_at_row_tokens_and_never_split_a_prompt():
    suffixes = [[i, i + 1, i + 2] for i in range(0, 30, 3)] + [list(range(100, 112))]
    tree = token_tree(suffixes, prefix_len=2, pad_id=0, row_tokens=7)
    per_row = {}
    for cols, row in zip(tree.columns, tree.rows):
        per_row.setdefault(row, set()).update(cols)
    assert len(per_row) > 1
    # a row holds at most row_tokens nodes unless one prompt alone is longer
    assert all(len(cols) <= 7 or len(cols) == 12 for cols in per_row.values())


def test_a_prompt_with_no_token_of_its_own_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        token_tree([[1], []], prefix_len=3, pad_id=0)


# --------------------------------------------------------------------------- the engine
from torchrl_oni.serve.models import TEST_MODEL, is_installed, resolve_model  # noqa: E402

needs_model = pytest.mark.skipif(not is_installed(TEST_MODEL),
                                 reason=f"model package missing: {resolve_model(TEST_MODEL).pip_install}")

MESSAGES = ["You kill the newt!", "You kill the jackal!", "You kill the newt!", "It's a wall.",
            "You see here 14 gold pieces.", "You see here a dagger.", "Welcome to experience level 2.",
            "Never mind.", "x"]


def _prompt(message):
    from torchrl_oni.annotators.prompts import render_text, short_messages

    return render_text(short_messages(message), style="plain")


@pytest.fixture(scope="module")
def engines():
    from torchrl_oni.serve.engines import make_engine

    torch.set_num_threads(1)
    # float32, so the layouts can be held to a plain forward's numbers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model honours the tree's mask: no fallback warning
        tree = make_engine("embedded", TEST_MODEL, dtype="float32", threads=1)
    padded = make_engine("embedded", TEST_MODEL, dtype="float32", threads=1, layout="padded")
    assert (tree.layout, padded.layout) == ("tree", "padded")
    return tree, padded


def _plain_top(engine, prompt, k=5):
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        logp = torch.log_softmax(engine.model(ids).logits[0, -1].float(), -1)
    top = logp.topk(k)
    return [float(v) for v in top.values]


@needs_model
@pytest.mark.parametrize("row_tokens", [256, 12])
def test_tree_scores_each_prompt_as_a_plain_forward(engines, row_tokens):
    tree, padded = engines
    tree.row_tokens = row_tokens  # 12: the batch spreads over several rows
    prompts = [_prompt(m) for m in MESSAGES]
    try:
        got = tree.complete(prompts, max_tokens=1, top_logprobs=5)
    finally:
        tree.row_tokens = 256
    want = padded.complete(prompts, max_tokens=1, top_logprobs=5)
    for prompt, g, w in zip(prompts, got, want):
        plain = _plain_top(tree, prompt)
        assert [v for _, v in g.top_logprobs[0]] == pytest.approx(plain, abs=1e-4)
        assert [v for _, v in w.top_logprobs[0]] == pytest.approx(plain, abs=1e-4)
        assert g.tokens == w.tokens and g.prompt_tokens == w.prompt_tokens


@needs_model
def test_tree_generates_the_tokens_of_padded_batches(engines):
    tree, padded = engines
    prompts = ["The capital of France is", "The capital of Spain is", "1, 2, 3, 4,", "1, 2, 3,",
               _prompt("You kill the newt!"), _prompt("You kill the jackal!")]
    got = tree.complete(prompts, max_tokens=6, top_logprobs=2)
    want = padded.complete(prompts, max_tokens=6, top_logprobs=2)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason and g.text == w.text
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4)
    alone = [tree.complete([p], max_tokens=6)[0] for p in prompts]
    assert [a.tokens for a in alone] == [g.tokens for g in got]


@needs_model
def test_a_model_that_ignores_the_trees_mask_runs_padded_with_one_warning():
    from torchrl_oni.serve.engines import TransformersEngine
    from torchrl_oni.serve.models import load_model

    loaded = load_model(TEST_MODEL, dtype="float32", threads=1)
    model = loaded.model
    forward = model.forward

    def without_custom_masks(*args, **kwargs):  # as a model whose attention builds its own mask
        if getattr(kwargs.get("attention_mask"), "dim", lambda: 2)() == 4:
            kwargs["attention_mask"] = None
        return forward(*args, **kwargs)

    model.forward = without_custom_masks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = TransformersEngine(loaded)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert engine.layout == "padded"
    assert len(said) == 1 and "does not honour a token tree's attention mask" in said[0], said
    prompt = _prompt("You kill the newt!")
    got = engine.complete([prompt, _prompt("It's a wall.")], max_tokens=1, top_logprobs=5)[0]
    assert [v for _, v in got.top_logprobs[0]] == pytest.approx(_plain_top(engine, prompt), abs=1e-4)
    with pytest.raises(ValueError, match="unknown layout"):
        TransformersEngine(loaded, layout="ragged")
    assert math.isfinite(got.token_logprobs[0])

"""A batch as one token tree: the layout (each distinct run of leading tokens once, each node seeing
the shared prefix and its own ancestors at its own position), and the embedded engine scoring and
generating through it exactly as through padded batches and as each prompt alone."""
import math
import random
import warnings

import pytest
import torch

from torchrl_oni.serve._token_tree import token_tree


def _ancestor_mask(tree, prefix_len, cached=None, past_width=0):
    """The mask rebuilt from each prompt's columns alone: a node sees the prefix, the prompt's
    cached tokens, the nodes before it on the prompt's path, and itself."""
    rows, width = tree.input_ids.shape
    cached = cached or [[] for _ in tree.columns]
    start = prefix_len + past_width
    want = torch.zeros((rows, 1, width, start + width), dtype=torch.bool)
    want[..., :prefix_len] = True
    for r in range(rows):
        for c in range(width):
            want[r, 0, c, start + c] = True
    for (row, _), cols, past in zip(tree.last.tolist(), tree.columns, cached):
        for j, c in enumerate(cols):
            for p in past:
                want[row, 0, c, prefix_len + p] = True
            for a in cols[:j]:
                want[row, 0, c, start + a] = True
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


def test_cached_beginnings_are_seen_as_past_columns_and_not_run_again():
    rng = random.Random(1)
    for _ in range(30):
        suffixes = [[rng.choice([3, 4, 5]) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 10))]
        # a trie of earlier batches: a prompt's first k tokens are held at the columns of their paths
        held = {}
        for s in suffixes:
            for k in range(1, len(s)):
                if rng.random() < 0.5 and (k == 1 or tuple(s[:k - 1]) in held):
                    held.setdefault(tuple(s[:k]), len(held))
        cached = []
        for s in suffixes:
            cols = []
            while len(cols) < len(s) - 1 and tuple(s[:len(cols) + 1]) in held:
                cols.append(held[tuple(s[:len(cols) + 1])])
            cached.append(cols)
        prefix_len = rng.randint(0, 3)
        tree = token_tree(suffixes, prefix_len=prefix_len, pad_id=99, row_tokens=rng.randint(1, 20),
                          cached=cached, past_width=len(held))
        assert torch.equal(tree.mask, _ancestor_mask(tree, prefix_len, cached, len(held)))
        for suffix, cols, past, row in zip(suffixes, tree.columns, cached, tree.rows):
            assert tree.input_ids[row, cols].tolist() == suffix[len(past):]  # only the new tokens run
            assert tree.position_ids[row, cols].tolist() == list(range(prefix_len + len(past), prefix_len + len(suffix)))
    with pytest.raises(ValueError, match="last token cannot be cached"):
        token_tree([[1, 2]], prefix_len=0, pad_id=0, cached=[[0, 1]], past_width=2)


def test_node_cache_keeps_parents_of_what_it_holds_when_it_evicts():
    from torchrl_oni.serve._node_cache import NodeCache

    rng = random.Random(2)
    cache = NodeCache(capacity=16)
    cache.reset(root=(0,))
    paths = {}  # slot -> path, as stored
    for _ in range(60):
        suffixes = [[rng.choice([1, 2, 3]) for _ in range(rng.randint(2, 6))] for _ in range(rng.randint(1, 4))]
        nodes, nodes_path, known = [], [], {}
        for s in suffixes:
            slots = cache.walk(s, len(s) - 1)
            for k, slot in enumerate(slots):
                assert paths[slot] == tuple(s[:k + 1])  # a walk finds what was stored under that path
            parent = slots[-1] if slots else -1
            for d in range(len(slots), len(s) - 1):
                path = tuple(s[:d + 1])
                if path not in known:
                    known[path] = len(nodes)
                    nodes.append((parent, s[d]))
                    nodes_path.append(path)
                parent = -2 - known[path]
        kv = [(torch.zeros(1, len(nodes), 1), torch.zeros(1, len(nodes), 1))]
        for slot, path in zip(cache.store(nodes, kv), nodes_path):
            if slot >= 0:
                paths[slot] = path
        # every node held is reachable: its parent is held too
        held = {slot: path for slot, path in paths.items() if cache._children.get(
            (int(cache._parent[slot]), int(cache._token[slot]))) == slot}
        assert len(held) == len(cache) <= 16
        for slot, path in held.items():
            parent = int(cache._parent[slot])
            assert parent == -1 if len(path) == 1 else held.get(parent) == path[:-1]


def test_rows_share_the_nodes_evenly_and_never_split_a_prompt():
    rng = random.Random(3)
    for _ in range(20):
        suffixes = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(2, 40))]
        row_tokens = rng.randint(5, 60)
        tree = token_tree(suffixes, prefix_len=2, pad_id=0, row_tokens=row_tokens)
        per_row = {}
        for cols, row in zip(tree.columns, tree.rows):
            per_row.setdefault(row, set()).update(cols)  # a prompt's columns all lie in its own row
        distinct = len({tuple(s[:d + 1]) for s in suffixes for d in range(len(s))})
        rows = -(-distinct // row_tokens)
        share = -(-distinct // rows)
        sizes = [len(per_row[r]) for r in sorted(per_row)]
        longest = max(len(s) for s in suffixes)
        # each row but the last holds its share, and no row more than its share and one prompt
        assert all(share <= n < share + longest for n in sizes[:-1]) and sizes[-1] < share + longest
        assert len(sizes) <= rows + 1 and tree.input_ids.shape == (len(sizes), max(sizes))


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
@pytest.mark.parametrize("node_cache_mb", [256, 0.05])  # 0.05 MB: a few dozen tokens, evicted often
def test_tokens_from_earlier_batches_give_a_plain_forwards_numbers(node_cache_mb):
    from torchrl_oni.serve.engines import make_engine

    engine = make_engine("embedded", TEST_MODEL, dtype="float32", threads=1, node_cache_mb=node_cache_mb)
    assert engine.node_cache is not None
    if node_cache_mb < 1:
        assert engine.node_cache.capacity < 200
    batches = [MESSAGES[:4], ["You kill the jackal!", "You see here a dagger!", "You see here 3 gold pieces."],
               ["You kill the newt", "Never mind.", "x", "You see here a dagger."], ["You see here a scroll."]]
    for messages in batches:
        prompts = [_prompt(m) for m in messages]
        hits = engine.node_cache.hits
        got = engine.complete(prompts, max_tokens=3, top_logprobs=5)
        for prompt, g in zip(prompts, got):
            assert [v for _, v in g.top_logprobs[0]] == pytest.approx(_plain_top(engine, prompt), abs=1e-4)
            assert g.tokens == engine.complete([prompt], max_tokens=3)[0].tokens
    assert engine.node_cache.hits > hits  # the last batch's caption began as earlier ones did
    assert engine.node_cache.root is not None and len(engine.node_cache) > 0


@needs_model
def test_a_prompt_alone_keeps_its_caption_not_the_templates_ending():
    """The template's tokens after the caption follow each caption once: a batch shows them as its
    common ending and they are not kept; a prompt alone, which shows no ending, leaves out the one
    the last batch showed, so it keeps only its caption's new tokens."""
    from torchrl_oni.serve.engines import make_engine

    engine = make_engine("embedded", TEST_MODEL, dtype="float32", threads=1, node_cache_mb=256)
    node = engine.node_cache
    engine.complete([_prompt(m) for m in MESSAGES[:4]], max_tokens=1)
    assert node.ending, "a batch of captions in one template shows the template's ending"
    ids = engine.tokenizer(_prompt("Zebra quagga okapi.")).input_ids
    suffix = ids[len(node.root):]
    assert tuple(suffix[-len(node.ending):]) == node.ending
    held = len(node.walk(suffix, len(suffix) - 1))
    before = len(node)
    prompt = _prompt("Zebra quagga okapi.")
    plain = _plain_top(engine, prompt)
    alone = engine.complete([prompt], max_tokens=1, top_logprobs=5)[0]
    assert len(node) - before == len(suffix) - len(node.ending) - held
    hits = node.hits
    again = engine.complete([prompt], max_tokens=1, top_logprobs=5)[0]  # its caption from the cache
    assert node.hits - hits == len(suffix) - len(node.ending)
    for answer in (alone, again):
        assert [v for _, v in answer.top_logprobs[0]] == pytest.approx(plain, abs=1e-4)


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

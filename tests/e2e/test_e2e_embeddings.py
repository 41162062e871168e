"""`flowllm serve` of embedding and reranking models, through the openai SDK and httpx,
against sentence-transformers on the same random checkpoints.

Three servers, each as a user starts it (`--task auto` reads the checkpoint): a BERT
embedder (CLS pooling, normalized, Matryoshka), a BERT cross-encoder, and a Qwen3 in the
Qwen3-Embedding layout. Every answer is checked against sentence-transformers' `encode`,
`CrossEncoder.predict` or its cosine similarity; the bad inputs get OpenAI's error body
with the right status, including the endpoints a task does not serve.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from e2e_helpers import assert_error, start_server
from embedding_fixtures import build_bert_dir, build_qwen3_embedder_dir
from server_process import ServerProcess

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france?",
    "paris is the capital and the largest city of france.",
    "a small red bird flew over the blue sea",
]
QUERY = "what is the capital of france?"
DOCUMENTS = [
    "the cat sat on the mat.",
    "paris is the capital of france.",
    "berlin is a large city in germany.",
]
FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB")
MAX_LEN = 128  # the BERTs' max_position_embeddings


def _serve(model: Path) -> Iterator[ServerProcess]:
    proc = start_server(str(model), FLAGS)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_dir(tmp_path_factory.mktemp("bert-embed"), pooling="cls", matryoshka=True)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_dir(tmp_path_factory.mktemp("bert-rerank"), cross_encoder=True)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_embedder_dir(tmp_path_factory.mktemp("qwen3-embed"))


@pytest.fixture(scope="module")
def bert_server(bert_dir: Path) -> Iterator[ServerProcess]:
    yield from _serve(bert_dir)


@pytest.fixture(scope="module")
def rerank_server(cross_encoder_dir: Path) -> Iterator[ServerProcess]:
    yield from _serve(cross_encoder_dir)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir: Path) -> Iterator[ServerProcess]:
    yield from _serve(qwen3_dir)


def _encode(model: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model), device="cpu", local_files_only=True)
    return np.asarray(st.encode(texts, convert_to_numpy=True))


def _close(got: object, expected: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), expected, atol=2e-6, rtol=1e-5)


def test_embeddings_through_the_sdk_are_sentence_transformers(
    bert_server: ServerProcess, bert_dir: Path
) -> None:
    client = bert_server.client()
    expected = _encode(bert_dir, TEXTS)
    # The SDK asks for base64 unless told otherwise and decodes it: the float32 bytes.
    default = client.embeddings.create(model=bert_server.model, input=TEXTS)
    _close([d.embedding for d in default.data], expected)
    assert [d.index for d in default.data] == list(range(len(TEXTS)))
    floats = client.embeddings.create(
        model=bert_server.model, input=TEXTS, encoding_format="float"
    )
    _close([d.embedding for d in floats.data], expected)
    raw = client.embeddings.create(
        model=bert_server.model, input=TEXTS[0], encoding_format="base64"
    )
    (only,) = raw.data
    assert isinstance(only.embedding, str)
    _close(np.frombuffer(base64.b64decode(only.embedding), dtype="<f4"), expected[0])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bert_dir))
    tokens = sum(len(tokenizer.encode(text)) for text in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    assert floats.model == bert_server.model and floats.object == "list"
    metrics = bert_server.metrics()  # embeddings read prompts and generate nothing
    assert metrics["flowllm:generation_tokens_total"] == 0
    assert metrics["flowllm:prompt_tokens_total"] >= 2 * tokens


def test_token_id_inputs_embed_as_their_text(bert_server: ServerProcess, bert_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bert_dir))
    ids = [tokenizer.encode(text) for text in TEXTS[:2]]
    client = bert_server.client()
    one = client.embeddings.create(model=bert_server.model, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=bert_server.model, input=ids, encoding_format="float")
    expected = _encode(bert_dir, TEXTS[:2])
    _close(one.data[0].embedding, expected[0])
    _close([d.embedding for d in many.data], expected)


def test_dimensions_truncate_then_normalize(bert_server: ServerProcess, bert_dir: Path) -> None:
    full = _encode(bert_dir, TEXTS)[:, :8]
    expected = full / np.linalg.norm(full, axis=1, keepdims=True)
    response = bert_server.client().embeddings.create(
        model=bert_server.model, input=TEXTS, dimensions=8, encoding_format="float"
    )
    _close([d.embedding for d in response.data], expected)
    assert all(len(d.embedding) == 8 for d in response.data)


def test_rerank_and_score_with_a_cross_encoder(
    rerank_server: ServerProcess, cross_encoder_dir: Path
) -> None:
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(cross_encoder_dir), device="cpu").predict(
        [(QUERY, doc) for doc in DOCUMENTS]
    )
    body = {"model": rerank_server.model, "query": QUERY, "documents": DOCUMENTS}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        response = httpx.post(f"{rerank_server.url}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
        assert [r["index"] for r in results] == order
        _close([r["relevance_score"] for r in results], expected[order])
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in order]
    as_objects = [{"text": doc} for doc in DOCUMENTS]
    top = httpx.post(
        f"{rerank_server.url}/v1/rerank",
        json={**body, "top_n": 1, "return_documents": False, "documents": as_objects},
        timeout=60,
    ).json()
    assert [r["index"] for r in top["results"]] == [int(np.argmax(expected))]
    assert "document" not in top["results"][0]
    assert top["usage"]["total_tokens"] > 0
    score = httpx.post(
        f"{rerank_server.url}/v1/score",
        json={"model": rerank_server.model, "text_1": QUERY, "text_2": DOCUMENTS},
        timeout=60,
    ).json()
    _close([d["score"] for d in score["data"]], expected)
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    pairwise = httpx.post(
        f"{rerank_server.url}/score",
        json={"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]},
        timeout=60,
    ).json()
    _close([d["score"] for d in pairwise["data"]], expected[:2])


def test_score_and_rerank_with_an_embedding_model_are_cosine_similarities(
    bert_server: ServerProcess, bert_dir: Path
) -> None:
    vectors = _encode(bert_dir, [QUERY, *DOCUMENTS])
    cosines = vectors[1:] @ vectors[0] / (
        np.linalg.norm(vectors[1:], axis=1) * np.linalg.norm(vectors[0])
    )
    score = httpx.post(
        f"{bert_server.url}/v1/score",
        json={"text_1": QUERY, "text_2": DOCUMENTS},
        timeout=60,
    ).json()
    _close([d["score"] for d in score["data"]], cosines)
    rerank = httpx.post(
        f"{bert_server.url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60
    ).json()
    assert [r["index"] for r in rerank["results"]] == list(np.argsort(-cosines))


def test_a_qwen3_embedder_through_the_sdk(qwen3_server: ServerProcess, qwen3_dir: Path) -> None:
    response = qwen3_server.client().embeddings.create(model=qwen3_server.model, input=TEXTS)
    _close([d.embedding for d in response.data], _encode(qwen3_dir, TEXTS))


def test_bad_embedding_requests_are_400s_naming_the_field(bert_server: ServerProcess) -> None:
    url = f"{bert_server.url}/v1/embeddings"

    def post(body: dict[str, object]) -> httpx.Response:
        return httpx.post(url, json=body, timeout=60)

    too_long = " ".join(["cat"] * (MAX_LEN + 10))
    error = assert_error(post({"input": too_long}), 400, code="context_length_exceeded")
    assert f"maximum context length is {MAX_LEN} tokens" in error["message"]
    assert assert_error(post({"input": ["a"] * 300}), 400)["param"] == "input"
    assert assert_error(post({"input": ""}), 400, code="empty_string")["param"] == "input"
    assert assert_error(post({"input": [[]]}), 400, code="empty_array")["param"] == "input"
    assert assert_error(post({"input": []}), 400, code="empty_array")["param"] == "input"
    assert assert_error(post({"input": [1, "a"]}), 400, code="invalid_type")["param"] == "input"
    assert assert_error(post({"input": [10**9]}), 400)["param"] == "prompt"
    assert assert_error(post({"input": "a", "dimensions": 0}), 400)["param"] == "dimensions"
    assert assert_error(post({"input": "a", "dimensions": 33}), 400)["param"] == "dimensions"
    bad_format = post({"input": "a", "encoding_format": "int8"})
    assert assert_error(bad_format, 400)["param"] == "encoding_format"
    assert assert_error(post({"input": "a", "truncate_prompt_tokens": 5}), 400)["param"] == (
        "truncate_prompt_tokens"
    )
    assert assert_error(post({"input": "a", "model": "other"}), 404)["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        bert_server.client().embeddings.create(model=bert_server.model, input=too_long)


def test_dimensions_need_a_matryoshka_model(qwen3_server: ServerProcess) -> None:
    body = {"input": "the cat", "dimensions": 8}
    response = httpx.post(f"{qwen3_server.url}/v1/embeddings", json=body, timeout=60)
    error = assert_error(response, 400)
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]


def test_each_task_serves_its_endpoints_only(
    server: ServerProcess, bert_server: ServerProcess, rerank_server: ServerProcess
) -> None:
    generation = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=60)
    error = assert_error(generation, 400, code="unsupported_task")
    assert "'generate' task" in error["message"] and "--task embed" in error["message"]
    with pytest.raises(openai.BadRequestError, match="generate"):
        server.client().embeddings.create(model=server.model, input="hello")
    for path in ("/v1/rerank", "/v1/score"):
        body = {"query": "a", "documents": ["b"], "text_1": "a", "text_2": "b"}
        assert_error(httpx.post(f"{server.url}{path}", json=body, timeout=60), 400)
    completion = httpx.post(
        f"{bert_server.url}/v1/completions", json={"prompt": "the cat"}, timeout=60
    )
    assert "'embed' task" in assert_error(completion, 400, code="unsupported_task")["message"]
    chat = httpx.post(
        f"{rerank_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert "'score' task" in assert_error(chat, 400, code="unsupported_task")["message"]
    embed = httpx.post(f"{rerank_server.url}/v1/embeddings", json={"input": "a"}, timeout=60)
    assert_error(embed, 400, code="unsupported_task")


def test_bad_score_and_rerank_requests(rerank_server: ServerProcess) -> None:
    url = rerank_server.url
    mismatched = httpx.post(
        f"{url}/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"]}, timeout=60
    )
    assert assert_error(mismatched, 400)["param"] == "text_2"
    empty = httpx.post(f"{url}/v1/score", json={"text_1": [], "text_2": "c"}, timeout=60)
    assert assert_error(empty, 400)["param"] == "text_1"
    many = httpx.post(f"{url}/v1/rerank", json={"query": "a", "documents": ["b"] * 300}, timeout=60)
    assert assert_error(many, 400)["param"] == "documents"
    negative = httpx.post(
        f"{url}/v1/rerank", json={"query": "a", "documents": ["b"], "top_n": -1}, timeout=60
    )
    assert assert_error(negative, 400)["param"] == "top_n"
    none = httpx.post(f"{url}/v1/rerank", json={"query": "a", "documents": []}, timeout=60)
    assert assert_error(none, 400)["param"] == "documents"
    long_pair = httpx.post(
        f"{url}/v1/rerank",
        json={"query": "a", "documents": [" ".join(["cat"] * MAX_LEN)]},
        timeout=60,
    )
    assert_error(long_pair, 400, code="context_length_exceeded")


def test_responses_match_the_openapi_document(
    bert_server: ServerProcess, rerank_server: ServerProcess
) -> None:
    import jsonschema

    for server, path, body in (
        (bert_server, "/v1/embeddings", {"input": TEXTS[:2]}),
        (bert_server, "/v1/embeddings", {"input": "a cat", "encoding_format": "base64"}),
        (rerank_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
        (rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
    ):
        doc = httpx.get(f"{server.url}/openapi.json", timeout=60).json()
        response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        ok = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
        jsonschema.Draft202012Validator(
            {**ok["schema"], "components": doc["components"]}
        ).validate(response.json())
        assert doc["paths"][path]["post"]["requestBody"]


BAD_BODIES = {
    "/v1/embeddings": [
        {}, {"input": None}, {"input": 5}, {"input": [[1, "a"]]}, {"input": [True]},
        {"input": "a", "dimensions": 10**30}, {"input": "a", "dimensions": "8"},
        {"input": "a", "normalize": "yes"}, {"input": "a", "encoding_format": None, "x": 1},
        {"input": [-1]}, {"input": {"text": "a"}}, {"input": [[[1]]]},
    ],
    "/v1/score": [
        {}, {"text_1": "a"}, {"text_1": 1, "text_2": "b"}, {"text_1": ["a"] * 300, "text_2": "b"},
        {"text_1": "a", "text_2": [["b"]]}, {"text_1": "a", "text_2": [""] * 0},
    ],
    "/v1/rerank": [
        {}, {"query": "a"}, {"query": 1, "documents": ["b"]}, {"query": "a", "documents": "b"},
        {"query": "a", "documents": [{"txt": "b"}]}, {"query": "a", "documents": [1]},
        {"query": "a", "documents": ["b"], "top_n": "1"}, {"query": "a", "documents": ["b"],
                                                           "rank_fields": ["x"]},
    ],
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(BAD_BODIES))
def test_malformed_pooling_bodies_are_400s(request: pytest.FixtureRequest, path: str) -> None:
    """Embeddings from the embedder, scores and reranking from the cross-encoder."""
    server: ServerProcess = request.getfixturevalue(
        "bert_server" if path == "/v1/embeddings" else "rerank_server"
    )
    for body in BAD_BODIES[path]:
        response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert_error(response, 400)
    nested = b'{"input": ' + b"[" * 100 + b"]" * 100 + b"}"
    deep = httpx.post(
        f"{server.url}{path}", content=nested,
        headers={"content-type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert_error(deep, 400, code="json_too_deep")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200

"""The README's exchange: `flowllm serve` with no model argument brings the bundled
SmolLM2-135M-Instruct up (found through FLOWLLM_CACHE, as on a fresh clone after the first
conversion), and the seed documents' request returns 50 tokens with usage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import start_server
from server_process import ServerProcess

BUNDLED = "smollm2-135m-instruct"


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_readme_completion_returns_50_tokens(bundled_server: ServerProcess) -> None:
    models = httpx.get(f"{bundled_server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [BUNDLED]
    request = {
        "model": BUNDLED, "prompt": "Today's weather is", "max_tokens": 50, "temperature": 0.5,
    }  # fmt: skip
    result = _post(bundled_server, "/v1/completions", request)
    choice = result["choices"][0]
    usage = result["usage"]
    assert result["object"] == "text_completion" and result["model"] == BUNDLED
    assert usage["prompt_tokens"] == 4  # SmolLM2's tokenizer: "Today", "'s", " weather", " is"
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert choice["text"].strip()
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 50
    else:  # sampled text may end at EOS; the 50 tokens are then asked for explicitly
        assert choice["finish_reason"] == "stop"
        forced = _post(bundled_server, "/v1/completions", {**request, "ignore_eos": True})
        assert forced["usage"]["completion_tokens"] == 50
        assert forced["choices"][0]["finish_reason"] == "length"


def test_readme_chat_knows_berlin(bundled_server: ServerProcess) -> None:
    client = bundled_server.client()
    answer = client.chat.completions.create(
        model=BUNDLED,
        messages=[{"role": "user", "content": "What is the capital of Germany?"}],
        temperature=0,
        max_tokens=32,
    )
    content = answer.choices[0].message.content or ""
    assert "Berlin" in content, content
    assert answer.choices[0].finish_reason == "stop"  # the model ends its turn by itself
    assert answer.usage is not None and answer.usage.completion_tokens < 32


def test_the_front_serves_without_torch(bundled_server: ServerProcess) -> None:
    """A front tokenizes, detokenizes and speaks HTTP, and never loads torch (the largest
    import of a start): the engine core alone does, and compiles the constraints the
    front's validate stage checks (its grammar engine imports torch). Neither loads
    Triton, which only CUDA attention needs."""
    client = bundled_server.client()
    for stream in (False, True):
        client.chat.completions.create(
            model=BUNDLED,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            logprobs=True,
            top_logprobs=2,
            stream=stream,
        )
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    answer = _post(bundled_server, "/v1/completions", {"prompt": "Yes or no?", **choice})
    assert answer["choices"][0]["text"] in ("yes", "no")
    bad = {"prompt": "Hi", "structured_outputs": {"regex": "("}}
    refused = httpx.post(f"{bundled_server.url}/v1/completions", json=bad, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "structured_outputs"

    def loads(pid: int, library: str) -> bool:
        return library in Path(f"/proc/{pid}/maps").read_text()

    fronts = bundled_server.processes_named("flowllm-front")
    cores = bundled_server.processes_named("flowllm-core")
    assert fronts and not any(loads(pid, "libtorch") for pid in fronts)
    assert cores and all(loads(pid, "libtorch") for pid in cores)
    # Triton serves CUDA only (the `cuda` extra): a CPU server never loads it.
    assert not any(loads(pid, "libtriton") for pid in fronts + cores)


def test_the_bundled_gguf_file_served_quantized_knows_berlin(smollm2_dir: Path) -> None:
    """`flowllm serve <the bundled Q4_1 file>`: weights kept quantized, tokenizer and chat
    template from the file's metadata, and the startup log says which kernels run."""
    from flowllm.models.bundled import bundled_gguf_path

    cache = smollm2_dir.parent.parent
    env = {"FLOWLLM_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    server = start_server(str(bundled_gguf_path()), ["--log-level", "info"], env=env)
    try:
        answer = server.client().chat.completions.create(
            model=str(bundled_gguf_path()),
            messages=[{"role": "user", "content": "What is the capital of Germany?"}],
            temperature=0,
        )
        assert answer.choices[0].message.content == "The capital of Germany is Berlin."
        log = server.output()
        assert "native CPU kernels" in log
        assert "Q4_1,Q8_0" in log  # the model weights line names the formats kept
    finally:
        server.stop()

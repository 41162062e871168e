"""examples/graphs/two-tokenizers.yaml: `replicas: 2` on tokenize gives the default graph's
outputs, for requests sent one at a time and all at once."""

from __future__ import annotations

import asyncio
from typing import Any

from example_server import EXAMPLES, MODEL_NAME
from server_process import ServerProcess

from flowllm.graph.validator import load_graph

TWO_TOKENIZERS_YAML = EXAMPLES / "graphs" / "two-tokenizers.yaml"
PROMPTS = [
    "Hello there",
    "The story begins",
    "Once upon a time, in a land far away,",
    "1 2 3 4 5",
    "Ünïcode prompts also tokenize the same way: naïve café",
    "def main():\n    return",
    "A",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def greedy_texts(server: ServerProcess, concurrent: bool) -> list[tuple[str, int]]:
    """(text, prompt tokens) per prompt, greedy, 8 tokens each."""

    async def one(client: Any, prompt: str) -> tuple[str, int]:
        out = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0.0
        )
        return out.choices[0].text, out.usage.prompt_tokens

    async def run() -> list[tuple[str, int]]:
        async with server.async_client() as client:
            if concurrent:
                return list(await asyncio.gather(*(one(client, p) for p in PROMPTS)))
            return [await one(client, p) for p in PROMPTS]

    return asyncio.run(run())


def test_two_tokenizers_graph_declares_two_replicas() -> None:
    graph = load_graph(TWO_TOKENIZERS_YAML)
    assert graph.stages["tokenize"].spec.replicas == 2
    assert graph.channels["tokenize.in"].producers[0].stage == "validate"


def test_two_tokenizers_give_the_default_outputs(
    default_server: ServerProcess, start_server: Any
) -> None:
    reference = greedy_texts(default_server, concurrent=False)
    server = start_server(TWO_TOKENIZERS_YAML)
    assert greedy_texts(server, concurrent=False) == reference
    assert greedy_texts(server, concurrent=True) == reference
    # Streaming goes through the same replicas.
    stream = server.client().completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=8, temperature=0.0, stream=True
    )
    assert "".join(e.choices[0].text for e in stream if e.choices) == reference[2][0]

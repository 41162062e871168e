"""The engine: the stage graph and the model it serves, in one process or as an engine core
with front processes."""

from pathlib import Path

DEFAULT_GRAPH = Path(__file__).with_name("default.yaml")
"""The graph every command runs unless given `--graph FILE` (docs/stages.md)."""
POOLING_GRAPH = Path(__file__).with_name("pooling.yaml")
"""The graph of a model served for pooling (`--task embed|score`) unless given `--graph`."""
SPECULATIVE_GRAPH = Path(__file__).with_name("speculative.yaml")
"""The graph of a model served with speculative decoding (`--speculative-config`)."""


def graph_for_task(task: str, speculative: bool = False) -> Path:
    """The built-in graph that serves a resolved task (flowllm.models.pooler_config): the
    pooling graph for embed and score, else the speculative one when `speculative`, else
    the default one."""
    if task in ("embed", "score"):
        return POOLING_GRAPH
    return SPECULATIVE_GRAPH if speculative else DEFAULT_GRAPH

"""The engine: the stage graph and the model it serves, in one process or as an engine core
with front processes."""

from pathlib import Path

DEFAULT_GRAPH = Path(__file__).with_name("default.yaml")
"""The graph every command runs unless given `--graph FILE` (docs/stages.md)."""
POOLING_GRAPH = Path(__file__).with_name("pooling.yaml")
"""The graph of a model served for pooling (`--task embed|score`) unless given `--graph`."""


def graph_for_task(task: str) -> Path:
    """The built-in graph that serves a resolved task (flowllm.models.pooler_config): the
    pooling graph for embed and score, else the default one."""
    return POOLING_GRAPH if task in ("embed", "score") else DEFAULT_GRAPH

"""The engine: the stage graph and the model it serves, in one process or as an engine core
with front processes."""

from pathlib import Path

DEFAULT_GRAPH = Path(__file__).with_name("default.yaml")
"""The graph every command runs unless given `--graph FILE` (docs/stages.md)."""

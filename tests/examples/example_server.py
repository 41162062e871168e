"""The example-graph tests' servers and graph files.

A server (tests/server_process.py) runs the tiny random GPT-2 (`--dtype float32
--max-model-len 512 --kv-cache-memory 64MiB`) with a graph file, exactly as a user would
start it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from server_process import REPO, TINY_FLAGS, ServerProcess

EXAMPLES = REPO / "examples"
MODEL_NAME = "tiny"


def example_server(
    model_dir: Path, graph: Path | None, log_dir: Path, cwd: Path | None = None
) -> ServerProcess:
    """`flowllm serve MODEL --graph GRAPH` served as `MODEL_NAME`, offline; not yet healthy."""
    return ServerProcess(
        model_dir,
        TINY_FLAGS,
        graph=graph,
        served_model_name=MODEL_NAME,
        env={"HF_HUB_OFFLINE": "1"},
        cwd=cwd,
        log_dir=log_dir,
    )


def copy_graph(source: Path, dest: Path, edit: Any = None) -> Path:
    """Copy a graph YAML to `dest`, with relative `.py` paths in `use:` made absolute
    (they are relative to the YAML's folder) and `edit(data)` applied to the parsed YAML."""
    data = yaml.safe_load(source.read_text())
    for stage in data["stages"]:
        module, sep, attr = stage["use"].rpartition(":")
        if module.endswith(".py") and not Path(module).is_absolute():
            stage["use"] = f"{(source.parent / module).resolve()}{sep}{attr}"
    if edit is not None:
        edit(data)
    dest.write_text(yaml.safe_dump(data, sort_keys=False))
    return dest


def stage_entry(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The stage entry named `name` in a parsed graph YAML."""
    for stage in data["stages"]:
        if stage["name"] == name:
            return stage  # type: ignore[no-any-return]
    raise KeyError(name)


def load_example_stage_module(name: str) -> ModuleType:
    """Import examples/stages/NAME.py as a module of its own (the examples are no package)."""
    path = EXAMPLES / "stages" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

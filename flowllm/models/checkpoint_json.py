"""Reading a checkpoint's JSON files (config.json, the safetensors index, the generation
config, the sentence-transformers files), a missing or unparsable one raised as a
`ModelLoadError` that names it.

A module of its own, below the loader, so that the pooler's config reader
(pooler_config.py), which the model classes import, reads the same files the same way
without importing the loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flowllm.models.load_errors import CorruptCheckpointError, MissingFileError, one_line


def read_json(path: Path, what: str) -> Any:
    """A checkpoint's JSON file; `what` names it in the errors."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise MissingFileError(f"{what} {path} is missing") from e
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{what} {path} is not valid JSON: {one_line(e)}") from e

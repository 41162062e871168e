"""Importing the stage classes a graph's `use:` names, from a module or a user's file."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType


class StageImportError(Exception):
    """Why a `use:` module could not be imported."""


def describe_import_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def import_file(path: Path) -> ModuleType:
    """Import a user's stage file once per process, under a name derived from its path."""
    path = path.resolve()
    if not path.is_file():
        raise StageImportError(f"file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"flowllm_user_stages.{path.stem}_{digest}"
    existing = sys.modules.get(module_name)
    if existing is not None:
        return existing
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise StageImportError(f"cannot load {str(path)!r} as Python")
    module = importlib.util.module_from_spec(spec)
    # Registered before executing so msgspec/typing can resolve the module's annotations.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise StageImportError(describe_import_error(exc)) from None
    return module

"""The errors of resolving and loading a model, each a `ModelLoadError` whose str() is one
line naming the model and what to do: the CLI prints it without a traceback.

They live apart from the loader (loader.py) so that the modules below it raise them
without importing it: the pooler's config reader (pooler_config.py), which the model
classes import, which the loader imports through the registry. `errors.py` holds the
errors the model classes raise as they are built; the loader turns those into these.
"""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be resolved or loaded; str() is one line saying what and why."""


class ModelNotFoundError(ModelLoadError):
    """No local directory or Hub repository by that name."""


class HubUnreachableError(ModelLoadError):
    """The Hub cannot be reached (or offline mode is on) and the model is not cached."""


class MissingFileError(ModelLoadError):
    """The model directory lacks a file it needs (config, weights, a shard, tokenizer)."""


class CorruptCheckpointError(ModelLoadError):
    """A checkpoint file exists but cannot be parsed."""


class UnknownArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one flowllm implements."""


class WeightMismatchError(ModelLoadError):
    """The checkpoint's tensors do not fit the model: a tensor missing or of the wrong shape."""


class BundledModelLoadError(ModelLoadError):
    """The bundled model cannot be found or converted."""


def one_line(error: BaseException) -> str:
    """An exception's message folded onto one line (the CLI prints exactly one)."""
    text = " ".join(str(error).split())
    return text or type(error).__name__

"""Errors raised while choosing, building or loading a model."""

from __future__ import annotations


class ModelError(RuntimeError):
    """Base class of the model errors; the message says what to fix."""


class UnsupportedModelError(ModelError):
    """The checkpoint's architecture is not one flowllm implements."""


class WeightLoadError(ModelError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape."""


class KVCacheError(ModelError):
    """The KV cache cannot be sized or allocated with the memory given."""

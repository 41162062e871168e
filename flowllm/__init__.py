"""flowllm: an OpenAI-compatible LLM inference server built as a dataflow graph of stages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowllm.version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]

if TYPE_CHECKING:
    from flowllm.llm import LLM
    from flowllm.messages import SamplingParams, StructuredOutputs


def __getattr__(name: str) -> Any:
    # Lazy so that `import flowllm` (and the CLI's --help) does not pay for torch.
    if name == "LLM":
        from flowllm.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputs"):
        from flowllm import messages

        return getattr(messages, name)
    raise AttributeError(f"module 'flowllm' has no attribute {name!r}")

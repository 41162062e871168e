"""Load the tokenizer (and its chat template) of a resolved model directory.

The tokenizer comes from the directory's own files through transformers (a fast,
Rust-backed tokenizer), or from a GGUF file's metadata (transformers rebuilds it); no
remote code runs. A chat template given by the user (a file
path, or the template text itself) replaces the model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowllm.models.bundled import SOURCE_FILE
from flowllm.models.load_errors import MissingFileError, ModelLoadError, one_line
from flowllm.models.loader import load_hf_config, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flowllm.config import EngineConfig

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")


class TokenizerLoadError(ModelLoadError):
    """The tokenizer or the chat template cannot be loaded."""


def read_chat_template(chat_template: str) -> str:
    """A chat template given as a path to a Jinja file, or as the template text itself."""
    looks_like_template = "{{" in chat_template or "{%" in chat_template
    if not looks_like_template:
        path = Path(chat_template).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except OSError as e:
            raise TokenizerLoadError(
                f"cannot read chat template file {chat_template!r}: {e.strerror or e}"
            ) from e
    return chat_template


def _model_config(path: Path) -> Any:
    """config.json as flowllm reads it; None when there is none flowllm can read (a
    tokenizer-only directory, another architecture): transformers then reads it itself."""
    try:
        return load_hf_config(path)
    except ModelLoadError:
        return None


def load_tokenizer(
    path: Path | str, chat_template: str | None = None, gguf: Path | None = None
) -> PreTrainedTokenizerBase:
    """The fast tokenizer for the model directory `path` (a transformers
    PreTrainedTokenizerFast), or of the GGUF file `gguf`, with `chat_template` (path or
    text) replacing the model's.

    `tokenizer.chat_template` is None when neither the model nor the caller gives one.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if gguf is not None:
        from flowllm.models.gguf_file import GGUFError
        from flowllm.models.gguf_file import load_tokenizer as gguf_tokenizer

        try:
            tokenizer = gguf_tokenizer(gguf)
        except GGUFError as e:
            raise TokenizerLoadError(one_line(e)) from e
    else:
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise MissingFileError(f"no tokenizer files in {path} (expected tokenizer.json)")
        try:
            if (path / SOURCE_FILE).is_file():
                # A directory flowllm converted (bundled.py) names the class it wrote its
                # tokenizer for; AutoTokenizer would pick the same one, after importing its
                # tables of every model's tokenizer, a share of each process's start
                # (benchmarks/README.md, "Start-up").
                tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
            else:
                from transformers import AutoTokenizer

                # The config is flowllm's own reading of config.json: transformers would
                # otherwise load its model config class, which imports most of its
                # modelling code.
                tokenizer = AutoTokenizer.from_pretrained(
                    str(path), trust_remote_code=False, config=_model_config(path)
                )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TokenizerLoadError(f"cannot load the tokenizer in {path}: {one_line(e)}") from e
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TokenizerLoadError(
            f"the tokenizer in {path} ({type(tokenizer).__name__}) has no fast implementation"
        )
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def tokenizer_source(config: EngineConfig) -> tuple[Path, str | None, Path | None]:
    """`load_tokenizer`'s arguments for `config`. Resolving converts the bundled model
    if needed."""
    if config.model.tokenizer is not None:
        return resolve_model(config.model.tokenizer).path, config.model.chat_template, None
    resolved = resolve_model(config.model.model, config.model.quantization)
    gguf = resolved.gguf if resolved.config_from_gguf else None
    return resolved.path, config.model.chat_template, gguf

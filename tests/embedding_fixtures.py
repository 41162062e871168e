"""Embedding and reranking checkpoints for tests and benchmarks, built here with random
weights (no network), laid out as their kind is on the Hub:

- `build_bert_dir`: a BERT (`BertModel`) with a WordPiece tokenizer written here and the
  sentence-transformers files of bge/e5-style models (modules.json, 1_Pooling/config.json,
  sentence_bert_config.json), pooling by [CLS] or mean, normalized or not, Matryoshka or
  not; with `cross_encoder=True`, a `BertForSequenceClassification` of one label instead
  (a reranker, as cross-encoder/ms-marco-*), its activation named or left to the default.
- `build_qwen3_embedder_dir`: a Qwen3 in the Qwen3-Embedding layout: the base model's
  tensors (no `model.` prefix, no LM head) under a `Qwen3ForCausalLM` config, the GPT-2
  tokenizer appending <|endoftext|> to every input, and last-token pooling, normalized.

Plain functions, so the benchmarks use them too (`sys.path.insert(0, "tests")`).
"""

from __future__ import annotations

import json
from pathlib import Path

from model_fixtures import GPT2_EOS, GPT2_EOS_ID, write_gpt2_tokenizer_files

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [
    "the", "a", "an", "of", "to", "in", "is", "was", "on", "at", "for", "with", "and", "or",
    "not", "what", "which", "who", "how", "many", "cat", "cats", "dog", "dogs", "bird",
    "sat", "ran", "flew", "mat", "table", "garden", "house", "city", "capital", "country",
    "paris", "berlin", "rome", "madrid", "france", "germany", "italy", "spain", "europe",
    "river", "mountain", "sea", "large", "small", "old", "new", "red", "blue", "green",
    "quick", "brown", "fox", "jumps", "over", "lazy", "embedding", "vector", "search",
    "query", "document", "passage", "answer", "question", "rank", "score", "model",
]
PUNCTUATION = list(".,?!;:'-")
LETTERS = list("abcdefghijklmnopqrstuvwxyz0123456789")
SUFFIXES = ["##s", "##es", "##ed", "##ing", "##ly", "##er", "##est"]


def wordpiece_vocab() -> list[str]:
    """The tokenizer's vocabulary: specials, words, punctuation, single characters and
    their continuations, so any lower-case ASCII text tokenizes without [UNK]."""
    return [*SPECIALS, *WORDS, *PUNCTUATION, *LETTERS, *(f"##{c}" for c in LETTERS), *SUFFIXES]


def write_wordpiece_tokenizer(dest: Path, max_length: int = 512) -> None:
    """A BERT (uncased) WordPiece tokenizer over `wordpiece_vocab()`, as transformers saves
    one: tokenizer.json and tokenizer_config.json (pairs: [CLS] a [SEP] b [SEP], the
    second text token type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizer

    vocab = {token: i for i, token in enumerate(wordpiece_vocab())}
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    core = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    core.decoder = decoders.WordPiece()
    tokenizer = BertTokenizer(
        tokenizer_object=core,
        do_lower_case=True,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )
    tokenizer.save_pretrained(str(dest))


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))


def write_sentence_transformers_files(
    dest: Path,
    *,
    pooling: str,
    dimension: int,
    normalize: bool,
    max_seq_length: int,
) -> None:
    """modules.json, the Pooling module's config (sentence-transformers' classic keys, as
    Hub models carry them) and sentence_bert_config.json."""
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")]
    if normalize:
        kinds.append(("2_Normalize", "Normalize"))
        (dest / "2_Normalize").mkdir(exist_ok=True)
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    _write_json(dest / "modules.json", modules)
    modes = {"cls": "cls_token", "mean": "mean_tokens", "lasttoken": "lasttoken"}
    pooling_config: dict[str, object] = {"word_embedding_dimension": dimension}
    for mode in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                 "weightedmean_tokens", "lasttoken"):  # fmt: skip
        pooling_config[f"pooling_mode_{mode}"] = mode == modes[pooling]
    pooling_config["include_prompt"] = True
    _write_json(dest / "1_Pooling" / "config.json", pooling_config)
    _write_json(
        dest / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length, "do_lower_case": False},
    )


def build_bert_dir(
    dest: Path,
    *,
    pooling: str = "cls",
    normalize: bool = True,
    num_hidden_layers: int = 2,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    intermediate_size: int = 48,
    max_position_embeddings: int = 128,
    max_seq_length: int | None = None,
    matryoshka: bool = False,
    cross_encoder: bool = False,
    activation: str | None = None,
    seed: int = 0,
) -> Path:
    """A random BERT with its tokenizer, float32 safetensors (see the module docstring).
    Biases and norm weights are random too (transformers starts them at 0 and 1)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    dest.mkdir(parents=True, exist_ok=True)
    write_wordpiece_tokenizer(dest, max_position_embeddings)
    config = BertConfig(
        vocab_size=len(wordpiece_vocab()), hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        initializer_range=0.2, pad_token_id=0, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    if cross_encoder:
        config.num_labels = 1
        if activation is not None:
            config.sentence_transformers = {"activation_fn": activation}
        model: torch.nn.Module = BertForSequenceClassification(config)
    else:
        if matryoshka:
            config.is_matryoshka = True
        model = BertModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "LayerNorm.weight" in name:
                p.normal_(1.0, 0.2)
    model.eval().save_pretrained(str(dest), safe_serialization=True)
    if not cross_encoder:
        write_sentence_transformers_files(
            dest,
            pooling=pooling,
            dimension=hidden_size,
            normalize=normalize,
            max_seq_length=max_seq_length or max_position_embeddings,
        )
    return dest


def build_qwen3_embedder_dir(
    dest: Path,
    *,
    tied: bool = True,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    seed: int = 0,
) -> Path:
    """A random Qwen3 in the Qwen3-Embedding layout (see the module docstring); `tied`:
    the config ties the embedding to the (absent) LM head, as the 0.6B's does."""
    import torch
    from tokenizers import Tokenizer, processors
    from transformers import Qwen3Config, Qwen3Model

    dest.mkdir(parents=True, exist_ok=True)
    write_gpt2_tokenizer_files(dest)
    core = Tokenizer.from_file(str(dest / "tokenizer.json"))
    core.post_processor = processors.TemplateProcessing(
        single=f"$A {GPT2_EOS}", special_tokens=[(GPT2_EOS, GPT2_EOS_ID)]
    )
    core.save(str(dest / "tokenizer.json"))
    tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text())
    tokenizer_config["pad_token"] = GPT2_EOS
    _write_json(dest / "tokenizer_config.json", tokenizer_config)
    config = Qwen3Config(
        vocab_size=GPT2_EOS_ID + 1, hidden_size=hidden_size, intermediate_size=96,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, max_position_embeddings=512, tie_word_embeddings=tied,
        rms_norm_eps=1e-6, initializer_range=0.15, bos_token_id=GPT2_EOS_ID,
        eos_token_id=GPT2_EOS_ID, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3Model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(str(dest), safe_serialization=True)
    saved = json.loads((dest / "config.json").read_text())
    saved["architectures"] = ["Qwen3ForCausalLM"]  # Qwen3-Embedding's config says so
    _write_json(dest / "config.json", saved)
    write_sentence_transformers_files(
        dest, pooling="lasttoken", dimension=hidden_size, normalize=True, max_seq_length=512
    )
    return dest

"""Tokenizers the tests build themselves, without network.

A plain function so benchmarks can use it too (`sys.path.insert(0, "tests")`).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

# Text the byte-fallback tokenizer learns from (its ASCII only).
_TRAINING_TEXT = Path(__file__).parents[1] / "docs" / "architecture.md"


def build_byte_fallback_tokenizer(dest: Path) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE with byte fallback, as Llama 2's and Mistral's, written to
    `dest/tokenizer.json`: "▁" for a space, the 256 byte tokens <0x00>..<0xFF> for the
    characters outside its small vocabulary, and a decoder that turns a run of byte tokens
    into text (U+FFFD per byte where the run is not UTF-8), then strips the text's leading
    space. Trained on ASCII text (600 tokens), so every other character decodes from byte
    tokens."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    backend = Tokenizer(BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], limit_alphabet=80
    )
    ascii_text = _TRAINING_TEXT.read_text().encode("ascii", "ignore").decode()
    backend.train_from_iterator([ascii_text], trainer)
    # the byte tokens are ordinary vocabulary, not added tokens
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(dest / "tokenizer.json"),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )

"""What a checkpoint is served for and how it pools, read from its config and its
sentence-transformers files (the classic keys of Hub models and the current ones), with
vLLM's defaults where there are none, and refusals that name what is not served."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flowllm.models.pooler_config import (
    PoolerConfig,
    UnsupportedTaskError,
    read_pooler_config,
    resolve_task,
)


def checkpoint(
    tmp_path: Path, config: dict[str, object], files: dict[str, object] | None = None
) -> Path:
    """A model directory: config.json and `files` (relative path -> JSON value)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name, value in (files or {}).items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    return tmp_path


BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 384}
CROSS = {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024}
MODULES = [
    {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
    for i, (path, kind) in enumerate(
        [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    )
]


def test_auto_reads_what_the_checkpoint_is_for(tmp_path: Path) -> None:
    assert resolve_task(checkpoint(tmp_path / "a", BERT), "auto") == "embed"
    assert resolve_task(checkpoint(tmp_path / "b", CROSS), "auto") == "score"
    assert resolve_task(checkpoint(tmp_path / "c", QWEN3), "auto") == "generate"
    with_st = checkpoint(tmp_path / "d", QWEN3, {"modules.json": MODULES})
    assert resolve_task(with_st, "auto") == "embed"
    assert resolve_task(with_st, "generate") == "generate"
    assert resolve_task(checkpoint(tmp_path / "e", QWEN3), "embed") == "embed"
    assert resolve_task(tmp_path / "e", "auto", from_gguf=True) == "generate"


@pytest.mark.parametrize(
    ("config", "task", "message"),
    [
        (BERT, "generate", "BertModel is an encoder: it serves embed or score"),
        (CROSS, "embed", "is a cross-encoder: it scores pairs (--task score)"),
        (BERT, "score", "--task score needs a cross-encoder"),
        (QWEN3, "score", "--task score needs a cross-encoder"),
    ],
)
def test_a_task_the_checkpoint_cannot_serve_is_refused_by_name(
    tmp_path: Path, config: dict[str, object], task: str, message: str
) -> None:
    with pytest.raises(UnsupportedTaskError, match=re.escape(message)):
        resolve_task(checkpoint(tmp_path, config), task)


def test_pooling_from_sentence_transformers_files(tmp_path: Path) -> None:
    legacy = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    model = checkpoint(
        tmp_path / "legacy", BERT, {"modules.json": MODULES, "1_Pooling/config.json": legacy,
                                    "sentence_bert_config.json": {"max_seq_length": 256}},
    )  # fmt: skip
    assert read_pooler_config(model, "embed") == PoolerConfig(
        task="embed", pooling="mean", normalize=True, size=384, max_seq_length=256
    )
    current = checkpoint(
        tmp_path / "current", {**QWEN3, "matryoshka_dimensions": [512, 128, 256]},
        {"modules.json": MODULES[:2], "1_Pooling/config.json": {"pooling_mode": "lasttoken"}},
    )  # fmt: skip
    assert read_pooler_config(current, "embed") == PoolerConfig(
        task="embed", pooling="last", normalize=False, size=1024, matryoshka=True,
        matryoshka_dimensions=(128, 256, 512),
    )  # fmt: skip
    assert read_pooler_config(current, "generate") is None


def test_without_sentence_transformers_files_vllms_defaults(tmp_path: Path) -> None:
    bert = read_pooler_config(checkpoint(tmp_path / "a", {**BERT, "is_matryoshka": True}), "embed")
    assert (bert.pooling, bert.normalize, bert.matryoshka) == ("cls", True, True)
    decoder = read_pooler_config(checkpoint(tmp_path / "b", QWEN3), "embed")
    assert (decoder.pooling, decoder.normalize, decoder.whole_prompts) == ("last", True, False)
    assert bert.whole_prompts


def test_a_cross_encoder_scores_through_its_activation(tmp_path: Path) -> None:
    default = read_pooler_config(checkpoint(tmp_path / "a", CROSS), "score")
    assert default == PoolerConfig(task="score", pooling="cls", normalize=False, size=1,
                                   activation="sigmoid")  # fmt: skip
    old = {**CROSS, "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}
    assert read_pooler_config(checkpoint(tmp_path / "b", old), "score").activation == "identity"
    tanh = {**CROSS, "sentence_transformers": {"activation_fn": "torch.nn.Tanh"}}
    with pytest.raises(UnsupportedTaskError, match=re.escape("activation 'torch.nn.Tanh'")):
        read_pooler_config(checkpoint(tmp_path / "c", tanh), "score")
    two = {**CROSS, "id2label": {"0": "no", "1": "yes"}}
    with pytest.raises(UnsupportedTaskError, match="with 2 labels cannot score"):
        read_pooler_config(checkpoint(tmp_path / "d", two), "score")


def test_unserved_sentence_transformers_modules_are_refused_by_name(tmp_path: Path) -> None:
    dense = [*MODULES, {"idx": 3, "name": "3", "path": "3_Dense",
                        "type": "sentence_transformers.models.Dense"}]  # fmt: skip
    with pytest.raises(UnsupportedTaskError, match=r"Dense.*flowllm runs Transformer"):
        read_pooler_config(checkpoint(tmp_path / "a", BERT, {"modules.json": dense}), "embed")
    for pooling, shown in (
        ({"pooling_mode_max_tokens": True}, "max"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "cls \\+ mean"),
        ({"pooling_mode": "weightedmean"}, "weightedmean"),
    ):
        files = {"modules.json": MODULES, "1_Pooling/config.json": pooling}
        model = checkpoint(tmp_path / shown[:3], BERT, files)
        with pytest.raises(UnsupportedTaskError, match=f"pooling mode {shown} "):
            read_pooler_config(model, "embed")

"""Reading checkpoints: safetensors (single and sharded), casting, configs, and load_model's
errors for a missing file, a corrupt file, an unknown architecture, a missing tensor and a
wrong shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowllm.models.load_errors import (
    CorruptCheckpointError,
    MissingFileError,
    ModelLoadError,
    UnknownArchitectureError,
    WeightMismatchError,
)
from flowllm.models.loader import (
    LoadedModel,
    iter_weights,
    load_generation_config,
    load_hf_config,
    load_model,
    safetensors_files,
)


def _copy_model_dir(src: Path, dest: Path, *, weights: bool = True) -> Path:
    """A writable copy of a fixture directory (fixtures are shared and read-only)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if weights or f.suffix != ".safetensors":
            shutil.copyfile(f, dest / f.name)
    return dest


def _assert_one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    print(type(err).__name__, text)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


def test_iter_weights_matches_safetensors(gpt2_tiny_dir: Path) -> None:
    expected = load_file(str(gpt2_tiny_dir / "model.safetensors"))
    got = dict(iter_weights(gpt2_tiny_dir))
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def test_iter_weights_casts_floats_and_keeps_integers(tmp_path: Path) -> None:
    save_file(
        {"w": torch.randn(4, 3), "ids": torch.arange(5, dtype=torch.int64)},
        str(tmp_path / "model.safetensors"),
    )
    got = dict(iter_weights(tmp_path, torch.bfloat16))
    assert got["w"].dtype == torch.bfloat16
    assert torch.equal(got["w"], load_file(str(tmp_path / "model.safetensors"))["w"].bfloat16())
    assert got["ids"].dtype == torch.int64 and got["ids"].tolist() == [0, 1, 2, 3, 4]


def _shard(src: Path, dest: Path) -> dict[str, torch.Tensor]:
    """Split src's weights into two shards with an index, as save_pretrained does."""
    _copy_model_dir(src, dest, weights=False)
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        shard_tensors = {n: tensors[n] for n in shard_names}
        save_file(shard_tensors, str(dest / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_sharded_checkpoint(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    expected = _shard(gpt2_tiny_dir, tmp_path / "sharded")
    assert [f.name for f in safetensors_files(tmp_path / "sharded")] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    got = dict(iter_weights(tmp_path / "sharded", torch.float32))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    # And the sharded directory loads into the model like the single-file one.
    loaded = load_model(str(tmp_path / "sharded"), dtype="float32", device="cpu")
    assert isinstance(loaded, LoadedModel)


def test_sharded_checkpoint_missing_shard(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "sharded"
    _shard(gpt2_tiny_dir, d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingFileError) as e:
        list(iter_weights(d))
    _assert_one_line(e.value, "model-00002-of-00002.safetensors")


def test_sharded_index_not_json(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "sharded"
    _shard(gpt2_tiny_dir, d)
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError) as e:
        list(iter_weights(d))
    _assert_one_line(e.value, "model.safetensors.index.json")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_safetensors(gpt2_tiny_dir: Path, tmp_path: Path, damage: str) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(
        {"garbage": b"\x00\x01not a safetensors file" * 10, "truncated": data[: len(data) // 2],
         "empty": b""}[damage]
    )
    with pytest.raises(CorruptCheckpointError) as e:
        list(iter_weights(d))
    _assert_one_line(e.value, str(f))
    with pytest.raises(CorruptCheckpointError):
        load_model(str(d), dtype="float32", device="cpu")


def test_no_weights(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m", weights=False)
    with pytest.raises(MissingFileError) as e:
        load_model(str(d), dtype="float32", device="cpu")
    _assert_one_line(e.value, "no safetensors weights", str(d))
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(MissingFileError) as e:
        list(iter_weights(d))
    _assert_one_line(e.value, "pytorch_model.bin")


def test_missing_config(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(MissingFileError) as e:
        load_model(str(d), dtype="float32", device="cpu")
    _assert_one_line(e.value, "config.json")


def test_unknown_model_type(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="frobnicator", architectures=["FrobnicatorForCausalLM"])
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError) as e:
        load_hf_config(d)
    _assert_one_line(e.value, "frobnicator", "FrobnicatorForCausalLM")


def test_architecture_transformers_knows_but_flowllm_does_not(
    gpt2_tiny_dir: Path, tmp_path: Path
) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m")
    config = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 100}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError) as e:
        load_model(str(d), dtype="float32", device="cpu")
    _assert_one_line(e.value, "BertForMaskedLM", str(d))


def test_load_model_gpt2_tiny(gpt2_tiny_dir: Path) -> None:
    loaded = load_model(str(gpt2_tiny_dir), dtype="bfloat16", device="cpu")
    assert loaded.path == gpt2_tiny_dir.resolve()
    assert loaded.hf_config.model_type == "gpt2" and loaded.hf_config.n_layer == 2
    assert loaded.generation_config == {
        "_from_model_config": True,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    }
    assert loaded.dtype == torch.bfloat16 and loaded.device == torch.device("cpu")
    assert type(loaded.model).__name__ == "GPT2Model"
    floats = [p for p in loaded.model.parameters() if p.is_floating_point()]
    assert floats and all(p.dtype == torch.bfloat16 for p in floats)
    # Every checkpoint value landed somewhere in the model (layout may be transposed).
    ckpt = load_file(str(gpt2_tiny_dir / "model.safetensors"))
    wte = ckpt["wte.weight"].bfloat16()
    assert any(p.shape == wte.shape and torch.equal(p, wte) for p in floats)


def test_load_model_missing_tensor(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["h.1.mlp.c_fc.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightMismatchError) as e:
        load_model(str(d), dtype="float32", device="cpu")
    _assert_one_line(e.value, "h.1.mlp.c_fc.weight")


def test_load_model_wrong_shape(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["h.0.attn.c_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightMismatchError) as e:
        load_model(str(d), dtype="float32", device="cpu")
    _assert_one_line(e.value, "h.0.attn.c_proj.weight")


def test_generation_config_absent_or_bad(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy_model_dir(gpt2_tiny_dir, tmp_path / "m", weights=False)
    (d / "generation_config.json").unlink()
    assert load_generation_config(d) == {}
    (d / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError):
        load_generation_config(d)


def test_bad_dtype(gpt2_tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model(str(gpt2_tiny_dir), dtype="float8", device="cpu")
    _assert_one_line(e.value, "float8")


def test_bad_device(gpt2_tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_model(str(gpt2_tiny_dir), dtype="float32", device="tpu:banana")
    _assert_one_line(e.value, "tpu:banana")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError) as e:
            load_model(str(gpt2_tiny_dir), dtype="float32", device="cuda")
        _assert_one_line(e.value, "CUDA")

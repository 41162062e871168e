"""A draft model cut from a Llama-layer checkpoint: its first `--layers` decoder layers,
its final norm and its LM head (tied to the embedding where the checkpoint ties them),
with its tokenizer, written as an HF-format directory (config.json, model.safetensors).

No smaller released SmolLM2 is at hand offline, so the speculative benchmark drafts for
the bundled SmolLM2-135M-Instruct with the first layers of the same model: the same
tokenizer and embedding, untrained for the shortcut (each layer's output meets the final
norm as it would after all 30).

    .venv/bin/python benchmarks/truncated_draft.py --layers 4 --out /tmp/smollm2-draft-4
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from flowllm.models.bundled import ensure_bundled_model

COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncate(source: Path, out: Path, layers: int) -> Path:
    """Write `source`'s first `layers` layers, norm, embedding and head into `out`."""
    config = json.loads((source / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']}]")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
            layer = _LAYER.match(name)
            if layer is None or int(layer.group(1)) < layers:
                tensors[name] = f.get_tensor(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for name in COPIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", help="an HF-format directory (default: the bundled model's)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    source = Path(args.source) if args.source else ensure_bundled_model()
    print(truncate(source, Path(args.out), args.layers))


if __name__ == "__main__":
    main()

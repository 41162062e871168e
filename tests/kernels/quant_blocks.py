"""Random GGUF blocks of every quantized format the server keeps quantized: random codes
and scale bytes with float16 super-scales in a sane range, so every bit of the block
layout is exercised (gguf's Python quantizer does not write the K formats)."""

from __future__ import annotations

import gguf
import numpy as np

# byte offsets of the float16 scale fields in a block, per format
_F16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, bytes per row]: n rows of k values in `type_name`'s blocks."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[type_name]:
        half = rng.uniform(0.001, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[..., off : off + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n, -1)

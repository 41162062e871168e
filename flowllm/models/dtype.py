"""Resolve the `dtype` setting (auto, float32, bfloat16, float16) to a torch dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flowllm.config import DTYPES, ConfigError
from flowllm.kernels import native
from flowllm.models.layers import config_get

_NAMED: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# CPU flags that give bf16 matmuls native speed (AVX512-BF16 dot products or AMX tiles).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_fast_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU lists AVX512-BF16 or AMX-BF16 in its flags (False if unreadable)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and _BF16_FLAGS & set(value.split()):
            return True
    return False


def native_build_lacks_bf16() -> bool:
    """Whether the native kernels run a build without bf16 products (the AVX2 build, also
    where it is forced on a CPU with AVX-512): such a machine computes bf16 slowly."""
    lib = native.library()
    return lib is not None and lib.isa != "avx512"


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    value = config_get(hf_config, "torch_dtype", None) or config_get(hf_config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return _NAMED.get(value.removeprefix("torch."))
    return None


def resolve_dtype(
    name: str,
    device: torch.device | str,
    hf_config: Any,
    cpuinfo: str | Path = "/proc/cpuinfo",
) -> torch.dtype:
    """The dtype to run in: an explicit name as given; `auto` = bf16 on CPUs with fast bf16
    (unless the native kernels run a build without bf16 products), else fp32; on CUDA the
    config's dtype (fp16 where it says bf16 but the GPU lacks it)."""
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {name!r}")
    if name != "auto":
        return _NAMED[name]
    device = torch.device(device)
    if device.type == "cuda":
        dtype = _config_dtype(hf_config) or torch.float16
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return torch.float16
        return dtype
    fast = cpu_has_fast_bf16(cpuinfo) and not native_build_lacks_bf16()
    return torch.bfloat16 if fast else torch.float32

"""Every C and C++ source of the kernels is formatted with the committed `.clang-format`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from flowllm.kernels.native_build import SOURCE_DIR


def _clang_format() -> str:
    """clang-format from PATH, else the `clang-format` wheel of the dev extra beside this
    interpreter."""
    found = shutil.which("clang-format") or shutil.which(
        "clang-format", path=str(Path(sys.executable).parent)
    )
    assert found, "clang-format is missing: install the dev extra (pip install -e '.[dev]')"
    return found


def test_c_sources_are_formatted() -> None:
    files = sorted([*SOURCE_DIR.glob("*.c"), *SOURCE_DIR.glob("*.cpp"), *SOURCE_DIR.glob("*.h")])
    assert (SOURCE_DIR / ".clang-format").is_file()
    assert files
    result = subprocess.run(
        [_clang_format(), "--dry-run", "--Werror", "--style=file", *map(str, files)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, "run clang-format -i on them:\n" + result.stderr[-3000:]


def test_the_check_fails_on_an_unformatted_file(tmp_path: Path) -> None:
    """The same command refuses a file that breaks the style."""
    shutil.copy(SOURCE_DIR / ".clang-format", tmp_path / ".clang-format")
    bad = tmp_path / "bad.c"
    bad.write_text("int  f( int x ){return x ;}\n")
    result = subprocess.run(
        [_clang_format(), "--dry-run", "--Werror", "--style=file", str(bad)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0

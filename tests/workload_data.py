"""Data for the workload tests, made here: no download, nothing written by Ballast."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_texts(limit_bytes: int) -> list[str]:
    """Source files of the Python standard library, in name order, up to `limit_bytes` of text."""
    out, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="replace")
        out.append(text)
        size += len(text.encode())
        if size >= limit_bytes:
            break
    return out

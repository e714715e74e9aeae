"""The DataLoader side of training.data (imports torch, so it lives apart from the numpy-only planning)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from training.data import Block, Decoder, read_block


class Spans(IterableDataset):
    """Decoded spans of a rank's epoch; worker w of k decodes spans w, w+k, ... so that the
    DataLoader, taking one item from each worker in turn, returns them in their planned order."""

    def __init__(self, data_dir: Path, fmt: str, blocks: list[Block], spans, decoder: Decoder, label: str,
                 wait_seconds: float):
        self.args = (Path(data_dir), fmt, blocks, spans, decoder, label, wait_seconds)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        data_dir, fmt, blocks, spans, decoder, label, wait = self.args
        info = get_worker_info()
        wid, k = (info.id, info.num_workers) if info else (0, 1)
        for b, rows in spans[wid::k]:
            x, y = read_block(data_dir, blocks[b], fmt, decoder, label, wait)
            yield torch.from_numpy(np.ascontiguousarray(x[rows])), torch.from_numpy(np.ascontiguousarray(y[rows]))

"""Imported once by training.launch's forkserver, so forked workers start with these already loaded.

Measured here (2 cores): `import torch` ~3.7 s with two workers starting at once, and
`torch._dynamo` ~3 s more, pulled in lazily by DistributedDataParallel's constructor; pyarrow ~0.5 s.
"""

import pyarrow.parquet  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
from torch.nn.parallel import DistributedDataParallel  # noqa: F401

import ballast.training.trainer  # noqa: F401

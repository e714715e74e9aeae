"""A model package of a team's own, installed only for a test: a module and a `.dist-info` directory
whose entry_points.txt registers it under `ballast.models`, on a directory the test puts on sys.path
and PYTHONPATH (what `pip install` of the README's example package leaves behind, minus the copy).

The README's "Bring your own model" section shows the same factory as a package of its own."""

from __future__ import annotations

from pathlib import Path

DIST = "team_models"
ENTRY_POINT = "team_net"

MODULE = '''
"""team_models: one factory for every Ballast task (the `ballast.models` entry point `team_net`)."""

import math

import torch
from torch import nn


class _Concat(nn.Module):
    """Several feature fields arrive as a dict of tensors by field name: flattened and joined."""

    def forward(self, x):
        if isinstance(x, dict):
            return torch.cat([x[k].flatten(1).float() for k in sorted(x)], dim=1)
        return x.flatten(1).float()


class _Regressor(nn.Module):
    def __init__(self, n_in, width, target_shape):
        super().__init__()
        self.target_shape = tuple(target_shape)
        self.net = nn.Sequential(_Concat(), nn.Linear(n_in, width), nn.ReLU(),
                                 nn.Linear(width, max(1, math.prod(self.target_shape))))

    def forward(self, x):
        return self.net(x).reshape(-1, *self.target_shape)


class _PerPixel(nn.Module):
    """(N, H, W) or (N, H, W, C) images to (N, classes, H, W) logits."""

    def __init__(self, channels, width, classes):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, classes, 1))

    def forward(self, x):
        x = x.float()
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
        return self.net(x)


class _Bigram(nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.out(torch.relu(self.embed(tokens)))


def factory(options, data):
    width = options.get("width", 32)
    task = data["task"]
    if task == "causal_lm":
        return _Bigram(data["vocab_size"], width)
    inputs = data.get("inputs") or {"x": {"shape": data["input_shape"]}}
    n_in = sum(math.prod(v["shape"]) for v in inputs.values())
    if task == "classification":
        return nn.Sequential(_Concat(), nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, data["num_classes"]))
    if task == "regression":
        return _Regressor(n_in, width, data["target_shape"])
    if task == "segmentation":
        shape = data["input_shape"]
        return _PerPixel(1 if len(shape) == 2 else shape[-1], width, data["num_classes"])
    raise ValueError(f"team_net: no model for task {task!r}")


factory.options_schema = {
    "type": "object",
    "properties": {"width": {"type": "integer", "minimum": 1, "maximum": 4096}},
    "additionalProperties": False,
}
'''


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_package() -> tuple[str, str]:
    """The README's "Bring your own model" example: (its module's source, its entry-point line)."""
    import re

    text = README.read_text()
    at = text.index("**Bring your own model.**")
    toml = re.compile(r"```toml\n(.*?)```", re.S).search(text, at).group(1)
    module = re.compile(r"```python\n(.*?)```", re.S).search(text, at).group(1)
    line = re.search(r'^\[project\.entry-points\."ballast\.models"\]\n(.+)$', toml, re.M).group(1)
    name, value = line.split("=", 1)
    return module, f"{name.strip()} = {value.strip().strip(chr(34))}"


def install(root: Path, *, readme: bool = False) -> Path:
    """Write the package under `root` (a sys.path entry); returns `root`. `readme`: the README's own
    example package instead of this module's (which covers every task)."""
    module, entry = readme_package() if readme else (MODULE, f"{ENTRY_POINT} = {DIST}:factory")
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{DIST}.py").write_text(module)
    info = root / f"{DIST}-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[ballast.models]\n{entry}\n")
    return root

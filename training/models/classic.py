"""The first built-in models: mlp, cnn and embed, as `ballast.models` factories.

Each takes `options` {hidden_size, dropout} (the spec's flat `training.hidden_size` / `training.dropout`
fill in what `training.model.options` leaves out) and predicts classes (classification: `num_classes`
logits) or values (regression: the label's shape). mlp takes several feature fields (flattened and
joined in the spec's field order); cnn and embed one image-like feature.
"""

from __future__ import annotations

import math
from typing import Any

OPTIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "hidden_size": {"type": "integer", "minimum": 1, "maximum": 65536},
        "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    },
    "additionalProperties": False,
}


def _head(data: dict[str, Any], name: str) -> tuple[int, list[int] | None]:
    """(outputs of the last layer, the shape to give them or None): num_classes for classification,
    the label's elements for regression."""
    task = data.get("task", "classification")
    if task == "classification":
        return int(data["num_classes"]), None
    if task == "regression":
        shape = [int(s) for s in data.get("target_shape") or []]
        return int(math.prod(shape)), shape
    raise ValueError(f"model {name!r} predicts classes or values (classification, regression), not task {task}")


def _one_input(data: dict[str, Any], name: str) -> list[int]:
    inputs = data.get("inputs") or {}
    if len(inputs) > 1:
        raise ValueError(f"model {name!r} takes one feature field, the data has {len(inputs)}"
                         f" ({', '.join(inputs)}); use mlp or a model of your own")
    return [int(s) for s in data["input_shape"]]


def _layers(module: Any) -> list[Any]:
    """The modules of `module` that hold parameters of their own (its layers), in order."""
    return [m for m in module.modules() if m is not module and any(True for _ in m.parameters(recurse=False))]


def _options(options: dict[str, Any]) -> tuple[int, float]:
    return int(options.get("hidden_size", 128)), float(options.get("dropout", 0.1))


def mlp(options: dict[str, Any], data: dict[str, Any]) -> Any:
    import torch
    import torch.nn as nn

    from ballast.training.models import reset_layers

    hidden, dropout = _options(options)
    out, shape = _head(data, "mlp")
    inputs = data.get("inputs") or {"x": {"shape": data["input_shape"]}}
    names = list(inputs)
    width = sum(int(math.prod(spec["shape"] or [1])) for spec in inputs.values())
    body = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, out))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = body  # the parameter names (net.0.weight...) are what checkpoints hold

        def ballast_blocks(self):
            """The linear layers (training.fsdp's units)."""
            return _layers(self.net)

        def ballast_init_weights(self):
            """PyTorch's initialization of every layer, in place (training.fsdp: the meta-device build)."""
            reset_layers(self)

        def forward(self, x):
            if isinstance(x, dict):
                x = torch.cat([x[n].reshape(len(x[n]), -1).float() for n in names], 1)
            y = self.net(x.reshape(len(x), -1).float())
            return y if shape is None else y.reshape(len(y), *shape)

    return MLP()


mlp.options_schema = OPTIONS_SCHEMA


def cnn(options: dict[str, Any], data: dict[str, Any]) -> Any:
    import torch.nn as nn

    from ballast.training.models import reset_layers

    hidden, dropout = _options(options)
    out, shape = _head(data, "cnn")
    input_shape = _one_input(data, "cnn")
    if len(input_shape) not in (2, 3):
        raise ValueError(f"model 'cnn' needs a 2-D or 3-D (H, W[, C]) input, got shape {input_shape}")
    channels = 1 if len(input_shape) == 2 else input_shape[2]
    height, width = input_shape[0], input_shape[1]

    class ToNCHW(nn.Module):
        def forward(self, x):  # (N, H*W*C) or (N, H, W[, C]) -> (N, C, H, W)
            return x.float().reshape(x.shape[0], height, width, channels).permute(0, 3, 1, 2)

    class Shaped(nn.Module):
        def forward(self, y):
            return y if shape is None else y.reshape(len(y), *shape)

    class CNN(nn.Sequential):  # a Sequential still: its parameters keep their names (0.weight...)
        def ballast_blocks(self):
            """The convolutions and linear layers (training.fsdp's units)."""
            return _layers(self)

        def ballast_init_weights(self):
            """PyTorch's initialization of every layer, in place (training.fsdp: the meta-device build)."""
            reset_layers(self)

    return CNN(
        ToNCHW(), nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(dropout), nn.Linear(64 * 4, hidden), nn.ReLU(),
        nn.Linear(hidden, out), Shaped())


cnn.options_schema = OPTIONS_SCHEMA


def embed(options: dict[str, Any], data: dict[str, Any]) -> Any:
    """Pixel values (0-255, e.g. uint8 images) as tokens: a learned embedding per value and per position,
    averaged, then an MLP. The embeddings stay in fp32 under mixed precision."""
    import torch
    import torch.nn as nn

    from ballast.training.models import fp32_embedding, reset_layers

    hidden, dropout = _options(options)
    out, shape = _head(data, "embed")
    positions = int(math.prod(_one_input(data, "embed")))

    class PixelEmbed(nn.Module):
        def __init__(self):
            super().__init__()
            self.values = fp32_embedding(256, hidden)
            self.positions = fp32_embedding(positions, hidden)
            self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out))
            self.register_buffer("index", torch.arange(positions), persistent=False)

        def ballast_blocks(self):
            """The two embeddings and the head (training.fsdp's units)."""
            return [self.values, self.positions, self.head]

        def ballast_init_weights(self):
            """PyTorch's initialization of every layer and the position index, in place (training.fsdp:
            the meta-device build)."""
            reset_layers(self)
            self.index.copy_(torch.arange(positions))

        def forward(self, x):
            tokens = x.reshape(x.shape[0], -1).round().clamp(0, 255).long()
            # The non-linearity before pooling lets a value mean something different at each position.
            e = torch.relu(self.values(tokens) + self.positions(self.index))
            y = self.head(e.mean(1))
            return y if shape is None else y.reshape(len(y), *shape)

    return PixelEmbed()


embed.options_schema = OPTIONS_SCHEMA

"""`unet`: a U-Net for segmentation, 2-D or 3-D by the input's rank.

The spatial dimensions are the label's (`data["target_shape"]`: feature [H, W] or [H, W, C] -> 2-D,
[D, H, W] or [D, H, W, C] -> 3-D); a trailing feature dimension beyond them is the channels. `depth`
down-samplings (each halving every spatial size, doubling the width from `base_width`), then as many
up-samplings with skip connections. Sizes that do not divide by 2^depth are padded and the output
cropped back. Output: (N, num_classes, *spatial) logits.
"""

from __future__ import annotations

import math
from typing import Any

OPTIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "depth": {"type": "integer", "minimum": 1, "maximum": 6},
        "base_width": {"type": "integer", "minimum": 1, "maximum": 1024},
    },
    "additionalProperties": False,
}


def unet(options: dict[str, Any], data: dict[str, Any]) -> Any:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from ballast.training.models import reset_layers

    depth, base = int(options.get("depth", 3)), int(options.get("base_width", 16))
    if data.get("task") != "segmentation":
        raise ValueError(f"model 'unet' segments (task segmentation), not task {data.get('task')}")
    spatial = [int(s) for s in data["target_shape"]]
    shape = [int(s) for s in data["input_shape"]]
    if len(spatial) not in (2, 3) or shape[:len(spatial)] != spatial:
        raise ValueError(f"model 'unet' needs a feature [H, W(, C)] or [D, H, W(, C)] whose leading dimensions"
                         f" are the label's {spatial}; got feature {shape}")
    dims = len(spatial)
    channels = int(math.prod(shape[dims:])) if len(shape) > dims else 1
    classes = int(data["num_classes"])
    conv, pool = (nn.Conv2d, nn.MaxPool2d) if dims == 2 else (nn.Conv3d, nn.MaxPool3d)
    up_conv = nn.ConvTranspose2d if dims == 2 else nn.ConvTranspose3d
    norm = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
    multiple = 2 ** depth

    def double(cin: int, cout: int) -> Any:
        return nn.Sequential(conv(cin, cout, 3, padding=1), norm(cout), nn.ReLU(inplace=True),
                             conv(cout, cout, 3, padding=1), norm(cout), nn.ReLU(inplace=True))

    widths = [base * 2 ** i for i in range(depth + 1)]

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.ModuleList([double(channels, widths[0])] + [double(widths[i], widths[i + 1])
                                                                      for i in range(depth)])
            self.pool = pool(2)
            self.up = nn.ModuleList(up_conv(widths[i + 1], widths[i], 2, stride=2) for i in reversed(range(depth)))
            self.merge = nn.ModuleList(double(2 * widths[i], widths[i]) for i in reversed(range(depth)))
            self.out = conv(widths[0], classes, 1)

        def ballast_blocks(self):
            """The double convolutions of each level, down and up (training.fsdp's units)."""
            return [*self.down, *self.merge]

        def ballast_init_weights(self):
            """PyTorch's initialization of every layer, batch norms' statistics included, in place
            (training.fsdp: the meta-device build)."""
            reset_layers(self)

        def forward(self, x):
            n = x.shape[0]
            x = x.float().reshape(n, *spatial, channels)
            x = x.permute(0, dims + 1, *range(1, dims + 1))  # channels first
            pad = []
            for size in reversed(spatial):  # F.pad takes the last dimension first
                pad += [0, -size % multiple]
            if any(pad):
                x = F.pad(x, pad)
            skips = []
            for i, block in enumerate(self.down):
                x = block(x if i == 0 else self.pool(x))
                skips.append(x)
            x = skips.pop()
            for up, merge in zip(self.up, self.merge):
                x = merge(torch.cat([up(x), skips.pop()], 1))
            y = self.out(x)
            return y[(slice(None), slice(None), *(slice(0, s) for s in spatial))]

    return UNet()


unet.options_schema = OPTIONS_SCHEMA

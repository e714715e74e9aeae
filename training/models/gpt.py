"""`gpt`: a decoder-only Transformer language model in plain PyTorch.

Pre-norm blocks (LayerNorm, causal self-attention through `F.scaled_dot_product_attention(is_causal=True)`
with rotary position embeddings on queries and keys, then an MLP), a final norm and an output layer
tied to the token embedding. Input: int64 token ids (N, T) with T <= the data's seq_len; output: logits
(N, T, vocab_size).
"""

from __future__ import annotations

from typing import Any

OPTIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "layers": {"type": "integer", "minimum": 1, "maximum": 256},
        "width": {"type": "integer", "minimum": 8, "maximum": 65536},
        "heads": {"type": "integer", "minimum": 1, "maximum": 1024},
        "mlp_ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 64},
        "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "vocab_size": {"type": "integer", "minimum": 2, "maximum": 4194304,
                       "description": "only for pre-tokenized ids whose dataset records no tokenizer"},
    },
    "additionalProperties": False,
}

DEFAULTS = {"layers": 4, "width": 256, "heads": 4, "mlp_ratio": 4.0, "dropout": 0.0}


def gpt(options: dict[str, Any], data: dict[str, Any]) -> Any:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    o = {**DEFAULTS, **options}
    layers, width, heads, dropout = int(o["layers"]), int(o["width"]), int(o["heads"]), float(o["dropout"])
    if data.get("task", "causal_lm") != "causal_lm":
        raise ValueError(f"model 'gpt' is a language model (task causal_lm), not for task {data.get('task')}")
    vocab = o.get("vocab_size") or data.get("vocab_size")
    if not vocab:
        raise ValueError("the data gives no vocab_size (pre-tokenized ids without a tokenizer):"
                         " set training.model.options.vocab_size")
    vocab = int(vocab)
    seq_len = int(data.get("seq_len") or data["input_shape"][0])
    if width % heads or (width // heads) % 2:
        raise ValueError(f"width {width} must be a multiple of heads {heads} with an even size per head"
                         f" (rotary positions rotate pairs)")
    head_dim = width // heads
    hidden = max(1, int(round(width * float(o["mlp_ratio"]))))

    # On the CPU whatever device the model is built on (the meta device under FSDP: training.fsdp), so that
    # ballast_init_weights can fill the buffers from them.
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device="cpu"), inv)  # (T, head_dim / 2)

    def rotate(x, cos, sin):  # x (N, H, T, D): rotate each (even, odd) pair by its position's angle
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width, bias=False)
            self.proj = nn.Linear(width, width, bias=False)

        def forward(self, x, cos, sin):
            n, t, _ = x.shape
            q, k, v = self.qkv(x).view(n, t, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            q, k = rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=dropout if self.training else 0.0)
            return self.proj(y.transpose(1, 2).reshape(n, t, width))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(width), Attention()
            self.norm2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            self.drop = nn.Dropout(dropout)

        def forward(self, x, cos, sin):
            x = x + self.drop(self.attn(self.norm1(x), cos, sin))
            return x + self.drop(self.mlp(self.norm2(x)))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.register_buffer("cos", torch.empty(angles.shape, dtype=torch.float32), persistent=False)
            self.register_buffer("sin", torch.empty(angles.shape, dtype=torch.float32), persistent=False)
            self.ballast_init_weights()

        def ballast_init_weights(self):
            """Every parameter and buffer initialized in place (also on sharded parameters, where
            training.fsdp builds the model on the meta device): norms to identity, linear layers and the
            embedding from N(0, 0.02), the residual projections scaled for depth (GPT-2), the rotary
            tables computed."""
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.reset_parameters()
            self.apply(self._init)
            for block in self.blocks:  # residual projections scaled for depth (GPT-2)
                nn.init.normal_(block.attn.proj.weight, std=0.02 / (2 * layers) ** 0.5)
                nn.init.normal_(block.mlp[2].weight, std=0.02 / (2 * layers) ** 0.5)
            with torch.no_grad():
                self.cos.copy_(angles.cos())
                self.sin.copy_(angles.sin())

        def ballast_blocks(self):
            """The Transformer blocks: each an FSDP unit and an activation-checkpointing unit
            (training.fsdp); the embedding (tied to the head) and the final norm stay with the root."""
            return list(self.blocks)

        @staticmethod
        def _init(m):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

        def forward(self, tokens):
            t = tokens.shape[1]
            if t > seq_len:
                raise ValueError(f"gpt: {t} tokens, more than the seq_len {seq_len} it was built for")
            x = self.drop(self.embed(tokens.long()))
            cos, sin = self.cos[:t], self.sin[:t]
            for block in self.blocks:
                x = block(x, cos, sin)
            return self.head(self.norm(x))

    return GPT()


gpt.options_schema = OPTIONS_SCHEMA

"""`hf_causal_lm`: a Hugging Face `transformers` causal language model, for fine-tuning (extra `hf`).

Options: `config` (a mapping for `transformers.AutoConfig.for_model`, e.g. {model_type: gpt2, n_layer: 2,
...}: a fresh model), or `path` (a local directory holding config.json and safetensors weights: loaded
with `use_safetensors=True`, never a pickle). The model's vocabulary must hold the dataset's token ids.
Its forward returns the logits tensor (N, T, vocab), as every Ballast language model does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OPTIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "config": {"type": "object", "required": ["model_type"],
                   "properties": {"model_type": {"type": "string", "minLength": 1}}},
        "path": {"type": "string", "minLength": 1},
    },
    "oneOf": [{"required": ["config"]}, {"required": ["path"]}],
    "additionalProperties": False,
}
LOCAL_ONLY: dict[str, Any] = {"trust_remote_code": False, "local_files_only": True}
"""What every load from a directory passes: never code from the model's folder or the Hub (its
`auto_map`), never a download (options.path is a local directory)."""


def hf_causal_lm(options: dict[str, Any], data: dict[str, Any]) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("hf_causal_lm needs the transformers package: pip install 'ballast[hf]'") from exc
    import torch.nn as nn

    if data.get("task") != "causal_lm":
        raise ValueError(f"model 'hf_causal_lm' is a language model (task causal_lm), not for task {data.get('task')}")
    if "path" in options:
        path = Path(options["path"])
        if not (path / "config.json").is_file():
            raise ValueError(f"options.path: {path} holds no config.json of a Hugging Face model")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"options.path: {path} holds no .safetensors weights (pickled weights are not loaded)")
        _no_remote_code(_json_object(path / "config.json"), f"options.path: {path / 'config.json'}")
        inner = transformers.AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, **LOCAL_ONLY)
    else:
        settings = dict(options["config"])
        _no_remote_code(settings, "options.config")
        kind = settings.pop("model_type")
        config = transformers.AutoConfig.for_model(kind, **settings)  # transformers' own class: nothing is read
        inner = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    # Weights saved in fp16 or bf16 load in that dtype (transformers honours the config's dtype): the
    # trainer keeps fp32 weights and lets `training.precision` cast the compute (fp16's loss scaler
    # refuses fp16 gradients outright).
    inner = inner.float()
    vocab = int(inner.get_input_embeddings().num_embeddings)
    if data.get("vocab_size") and int(data["vocab_size"]) > vocab:
        raise ValueError(f"the model's vocabulary has {vocab} tokens, the dataset's tokenizer {data['vocab_size']}")

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = inner
            self.register_load_state_dict_pre_hook(_from_transformers_names)

        def forward(self, tokens):
            return self.model(input_ids=tokens.long(), use_cache=False).logits

        def ballast_blocks(self):
            """The Transformer layers: the modules of the classes transformers keeps whole when it splits
            a model across devices (`_no_split_modules`, e.g. GPT2Block, LlamaDecoderLayer)."""
            return _no_split_blocks(self.model)

    return CausalLM()


def _json_object(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON config ({exc})") from exc
    if not isinstance(data, dict):
        raise TypeError(f"{path}: not a JSON object of a Hugging Face model's config")
    return data


def _no_remote_code(config: dict[str, Any], where: str) -> None:
    """A config that names code of its own (`auto_map`: Python files beside the weights or on the Hub) is
    refused: transformers would import and run that code to build the model. Only its built-in
    architectures are built here."""
    if "auto_map" in config:
        raise ValueError(f"{where}: names code of its own (auto_map {repr(config['auto_map'])[:120]}), which would"
                         f" run to build the model; hf_causal_lm builds transformers' own architectures only"
                         f" (trust_remote_code is off): remove auto_map and give a model_type transformers has")


def _no_split_blocks(model: Any) -> list[Any]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in inner]  # the outermost: a block inside a block is its own


def _from_transformers_names(module: Any, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Weights published for transformers (named as the inner model names them: `transformer.h.0...`,
    ballast.training.checkpoint.export) load into this wrapper too: its `model.` goes back in front."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "model.")]:
        state_dict[f"{prefix}model.{key[len(prefix):]}"] = state_dict.pop(key)


hf_causal_lm.options_schema = OPTIONS_SCHEMA
hf_causal_lm.meta_build = False  # from_pretrained reads weights as it builds: built whole (training.fsdp.build_sharded)

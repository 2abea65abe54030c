"""A tiny Llama-architecture Hugging Face directory with random weights, for demos and tests.

It carries a byte-level tokenizer (256 byte tokens + BOS/EOS) so text goes in and out; the
weights are random, so the text is noise: only speed and exactness can be read from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from tokenswift_trt.model.config import config_from_dict
from tokenswift_trt.model.decoder import LlamaModel
from tokenswift_trt.model.draft_layers import DraftLayers

BOS, EOS = "<s>", "</s>"


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens (ids 0..255), BOS = 256, EOS = 257; BOS is prepended on encode."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: ord(ch))
    vocab = {ch: index for index, ch in enumerate(alphabet)}
    vocab[BOS], vocab[EOS] = 256, 257
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 256)])
    return tokenizer


def tiny_llama_config(vocab_size: int = 258) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "medusa_heads": 3,
    }


def write_random_model(out_dir: str | Path, seed: int = 0, with_draft_layers: bool = True) -> Path:
    """Write config.json, model.safetensors (+ random draft layers) and tokenizer.json to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_llama_config()
    config = config_from_dict(raw)
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones_like(param)
        else:
            tensors[name] = torch.randn(param.shape, generator=generator) * 0.1
    if with_draft_layers:
        for name, param in DraftLayers(config).state_dict().items():
            key = "model.medusa_layers." + name.removeprefix("layers.")
            noise = torch.randn(param.shape, generator=generator) * 0.02
            tensors[key] = noise if name.endswith("linear.weight") else torch.ones_like(param)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    byte_level_tokenizer().save(str(out / "tokenizer.json"))
    (out / "README.md").write_text(
        "Random weights: generated text is noise. Made by `tokenswift-trt random-model`.\n"
    )
    return out

"""Model configuration read from a Hugging Face `config.json` (Llama 2/3.x and Qwen2 families)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError):
    """A model directory's config cannot be run by this runtime."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v projections
    o_bias: bool  # Llama `attention_bias` also biases o_proj
    mlp_bias: bool
    rope_theta: float
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type and its scaling parameters
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_draft_layers: int = 3

    @property
    def rope_type(self) -> str:
        return str(self.rope.get("rope_type", "default"))

    @property
    def kv_group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from the dict of a Hugging Face `config.json`."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    if architectures:
        architecture = architectures[0]
    elif model_type in ("llama", "qwen2"):
        architecture = "LlamaForCausalLM" if model_type == "llama" else "Qwen2ForCausalLM"
    else:
        raise ConfigError(
            f"config.json names no architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.pop("type", None) or rope.get("rope_type", "default")
        rope["rope_type"] = rope_type
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type in ("llama3", "yarn"):
            rope.setdefault(
                "original_max_position_embeddings",
                raw.get("original_max_position_embeddings", raw["max_position_embeddings"]),
            )
        attention_bias = bool(raw.get("attention_bias", False))
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_theta=rope_theta,
            rope=rope,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            num_draft_layers=int(raw.get("medusa_heads", raw.get("num_draft_layers", 3))),
        )
    except KeyError as missing:
        raise ConfigError(f"config.json lacks the key {missing.args[0]!r}") from None


def load_config(model_dir: Path) -> ModelConfig:
    """Read `model_dir/config.json`; raise `ConfigError` with the fix when it is absent or unusable."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}: pass a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error.msg} at line {error.lineno})") from None
    config = config_from_dict(raw)
    if config.num_heads % config.num_kv_heads:
        raise ConfigError(
            f"num_attention_heads {config.num_heads} is not a multiple of num_key_value_heads "
            f"{config.num_kv_heads}"
        )
    return config

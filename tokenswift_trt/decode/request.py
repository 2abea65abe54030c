"""One way from a request's settings to a `GenerationConfig`, for every entry point.

The dataclasses `GenerationConfig` and `SamplingConfig` hold the only defaults. An engine may
override some of them (a preset's paper settings, recorded in an engine directory's manifest),
and a request overrides those again. The CLI, the Triton handler, the bench and journal resume
all build their config through `config_from(defaults, overrides)`, with flat setting names
(`temperature`, `tree`, `kv_budget`, ...), so one request gives one config whichever way it came.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.model.engine_dir import MANIFEST, Manifest
from tokenswift_trt.model.sampling import SamplingConfig

SAMPLING_SETTINGS = tuple(f.name for f in dataclasses.fields(SamplingConfig))
GENERATION_SETTINGS = tuple(f.name for f in dataclasses.fields(GenerationConfig) if f.name != "sampling")
SETTINGS = SAMPLING_SETTINGS + GENERATION_SETTINGS
# settings that decide the generated tokens (a resumed journal keeps its own) / only their speed
OUTPUT_DECIDING = SAMPLING_SETTINGS + ("seed", "ignore_eos", "max_length")
# how a request adapts its draft layers, read only with adapt_drafts
ADAPTATION_SETTINGS = (
    "adapt_block",
    "adapt_span",
    "adapt_scope",
    "adapt_optimizer",
    "adapt_lr",
    "adapt_vocab",
)
# the speed-only settings that only TokenSwift reads (AR steps draft nothing)
TOKENSWIFT_ONLY = (
    "tree",
    "ngram_topk",
    "kv_budget",
    "kv_recent",
    "draft_source",
    "device_loop",
    "adapt_drafts",
    *ADAPTATION_SETTINGS,
)
SPEED_ONLY = TOKENSWIFT_ONLY + ("prefill_chunk", "static_steps", "compile_steps", "memory_budget")


def config_from(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> GenerationConfig:
    """`GenerationConfig` from an engine's `defaults` and a request's `overrides` (flat setting
    names; a None value means "not given"). Raises GenerationError naming a bad or unknown value."""
    given = {name: value for name, value in overrides.items() if value is not None}
    merged = {**defaults, **given}
    unknown = sorted(set(merged) - set(SETTINGS))
    if unknown:
        raise GenerationError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    if "max_new_tokens" not in merged:
        raise GenerationError("max_new_tokens is required")
    sampling = SamplingConfig(**{name: merged[name] for name in SAMPLING_SETTINGS if name in merged})
    config = GenerationConfig(  # the tree's text is parsed here, once (`TreeSpec`)
        sampling=sampling, **{name: merged[name] for name in GENERATION_SETTINGS if name in merged}
    )
    config.validate()
    return config


def settings_of(config: GenerationConfig) -> dict[str, Any]:
    """The flat settings of a config, the tree in its text form (`config_from({}, settings_of(c)) == c`)."""
    flat = {name: getattr(config, name) for name in GENERATION_SETTINGS}
    flat["tree"] = str(config.tree)
    flat.update({name: getattr(config.sampling, name) for name in SAMPLING_SETTINGS})
    return flat


def with_fixed_seed(config: GenerationConfig) -> GenerationConfig:
    """The config with a seed drawn now if it has none (a journal must know its seed to resume)."""
    if config.seed is not None:
        return config
    return dataclasses.replace(config, seed=random.SystemRandom().randrange(2**63))


def manifest_defaults(manifest: Manifest) -> dict[str, Any]:
    """An engine directory's defaults: its preset's settings and its maximum sequence length."""
    return {**manifest.defaults, "max_length": manifest.max_sequence_length}


def engine_dir_defaults(engine_dir: Path) -> dict[str, Any]:
    """`manifest_defaults` read from an engine directory's manifest alone, before anything loads (the
    values loading the engine reports); {} when it has no readable manifest (loading says what is wrong)."""
    try:
        return manifest_defaults(Manifest(**json.loads((Path(engine_dir) / MANIFEST).read_text())))
    except (OSError, ValueError, TypeError):
        return {}

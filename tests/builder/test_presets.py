"""Presets match the public configs of the models they name."""

from __future__ import annotations

import dataclasses

import pytest

from tokenswift_trt.builder.presets import PRESETS, REPOSITORY, PresetError, local_model_dir
from tokenswift_trt.decode.request import config_from, settings_of
from tokenswift_trt.model.config import config_from_dict, load_config

# (parameters in billions as published, hidden, layers, heads, kv heads, vocab)
PUBLIC = {
    "llama3.1-8b": (8.03, 4096, 32, 32, 8, 128256),
    "llama2-7b-yarn-128k": (6.74, 4096, 32, 32, 32, 32000),
    "qwen2.5-1.5b": (1.54, 1536, 28, 12, 2, 151936),
    "qwen2.5-7b": (7.62, 3584, 28, 28, 4, 152064),
    "qwen2.5-14b": (14.77, 5120, 48, 40, 8, 152064),
    "smollm2-135m": (0.13, 576, 30, 9, 3, 49152),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_preset_shapes_match_public_configs(name):
    billions, hidden, layers, heads, kv_heads, vocab = PUBLIC[name]
    preset = PRESETS[name]
    config = config_from_dict(preset.config)
    assert (
        config.hidden_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.vocab_size,
    ) == (hidden, layers, heads, kv_heads, vocab)
    assert preset.parameter_count() / 1e9 == pytest.approx(billions, abs=0.01)


def _config(name):
    return config_from(PRESETS[name].defaults, {"max_new_tokens": 1})


def test_paper_sampling_settings_per_model():
    assert (_config("llama3.1-8b").sampling.min_p, _config("llama3.1-8b").sampling.penalty) == (0.1, 1.2)
    assert (
        _config("llama2-7b-yarn-128k").sampling.top_p,
        _config("llama2-7b-yarn-128k").sampling.penalty,
    ) == (0.9, 1.15)
    assert _config("qwen2.5-14b").sampling.penalty == 1.13
    assert all(_config(name).ngram_topk == 20 for name in PRESETS)
    assert all(_config(name).sampling.penalty_window == 1024 for name in PUBLIC if name != "smollm2-135m")
    assert _config("swift-tiny").sampling.penalty_window == 256  # scaled to a tiny model's context


def test_presets_restate_no_default():
    """Presets are partial overrides: a value equal to the dataclasses' own default is not repeated."""
    base = settings_of(config_from({}, {"max_new_tokens": 1}))
    for preset in PRESETS.values():
        assert all(base[name] != value for name, value in preset.defaults.items()), preset.name
    assert config_from_dict(PRESETS["llama3.1-8b"].config).rope_type == "llama3"
    assert config_from_dict(PRESETS["llama2-7b-yarn-128k"].config).rope_type == "yarn"
    assert config_from_dict(PRESETS["qwen2.5-1.5b"].config).tie_word_embeddings


def test_a_prepared_smollm2_has_the_presets_shape():
    directory = REPOSITORY / PRESETS["smollm2-135m"].bundled
    if not (directory / "config.json").is_file():
        pytest.skip("models/smollm2-135m is not prepared here (`make models`)")
    imported, preset = load_config(directory), config_from_dict(PRESETS["smollm2-135m"].config)
    assert dataclasses.replace(imported, rope={}) == dataclasses.replace(preset, rope={})
    assert imported.rope_type == preset.rope_type == "default" and imported.rope_theta == preset.rope_theta


def test_a_preset_model_that_is_not_here_names_how_to_get_it():
    missing = dataclasses.replace(PRESETS["smollm2-135m"], bundled="models/not-prepared")
    with pytest.raises(PresetError, match="run `make models`"):
        local_model_dir(missing)
    with pytest.raises(PresetError, match="--model-dir"):
        local_model_dir(PRESETS["llama3.1-8b"])  # no local model: build an engine from its checkpoint
    directory, heads = local_model_dir(PRESETS["swift-tiny"])
    assert (directory / "config.json").is_file() and heads is None  # its heads live in its own dir

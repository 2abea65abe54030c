"""Presets match the public configs of the models they name."""

from __future__ import annotations

import pytest

from tokenswift_trt.builder.presets import PRESETS
from tokenswift_trt.runtime.config import config_from_dict

# (parameters in billions as published, hidden, layers, heads, kv heads, vocab)
PUBLIC = {
    "llama3.1-8b": (8.03, 4096, 32, 32, 8, 128256),
    "llama2-7b-yarn-128k": (6.74, 4096, 32, 32, 32, 32000),
    "qwen2.5-1.5b": (1.54, 1536, 28, 12, 2, 151936),
    "qwen2.5-7b": (7.62, 3584, 28, 28, 4, 152064),
    "qwen2.5-14b": (14.77, 5120, 48, 40, 8, 152064),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_preset_shapes_match_public_configs(name):
    billions, hidden, layers, heads, kv_heads, vocab = PUBLIC[name]
    preset = PRESETS[name]
    config = config_from_dict(preset.config)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.vocab_size) == (
        hidden, layers, heads, kv_heads, vocab
    )
    assert preset.parameter_count() / 1e9 == pytest.approx(billions, abs=0.01)


def test_paper_sampling_settings_per_model():
    assert (PRESETS["llama3.1-8b"].sampling.min_p, PRESETS["llama3.1-8b"].sampling.penalty) == (0.1, 1.2)
    assert (PRESETS["llama2-7b-yarn-128k"].sampling.top_p, PRESETS["llama2-7b-yarn-128k"].sampling.penalty) == (0.9, 1.15)
    assert PRESETS["qwen2.5-14b"].sampling.penalty == 1.13
    assert all(p.sampling.ngram_topk == 20 for p in PRESETS.values())
    assert config_from_dict(PRESETS["llama3.1-8b"].config).rope_type == "llama3"
    assert config_from_dict(PRESETS["llama2-7b-yarn-128k"].config).rope_type == "yarn"
    assert config_from_dict(PRESETS["qwen2.5-1.5b"].config).tie_word_embeddings

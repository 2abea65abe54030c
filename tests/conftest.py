"""Shared fixtures: tiny Hugging Face checkpoints written by transformers itself."""

from __future__ import annotations

import warnings

import pytest
import torch

from tokenswift_trt.model.engine import UntrainedDraftLayersWarning, load_engine

from helpers import llama_config, qwen2_config, save_hf_model

# The longest files run first: the tiers run on two processes (make test), and a long file collected
# last would run alone at the end while the other process idles.
LONGEST_FIRST = (
    "tests/tools/test_gpu_check_dry_run.py",
    "tests/cli/test_tp_generate.py",
    "tests/bench/test_batching_bench.py",
    "tests/kernels/test_triton_aligned.py",
    "tests/serving/test_supervision.py",
    "tests/serving/test_admission.py",
    "tests/bench/test_steps.py",
    "tests/plugins_cuda/test_plugin_build.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Put the `LONGEST_FIRST` files' tests first, the others after them in their order."""
    first = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """Llama 3-style GQA model with llama3 rope scaling; returns (dir, transformers model)."""
    directory = tmp_path_factory.mktemp("llama")
    config = llama_config(
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
    )
    return directory, save_hf_model(config, directory)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    return directory, save_hf_model(qwen2_config(), directory)


def quiet_load(directory, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntrainedDraftLayersWarning)
        return load_engine(directory, **kwargs)


@pytest.fixture(scope="session")
def llama_engine64(llama_dir):
    """float64 engine: exact-equality tests are then free of fp32 near-ties."""
    return quiet_load(llama_dir[0], dtype=torch.float64)


def _random_heads_engine64(llama_dir, tmp_path_factory, **layout):
    """float64 engine with random draft layers of that layout (`DraftLayers`' keyword arguments)."""
    path = random_heads_file(llama_dir, tmp_path_factory, **layout)
    return quiet_load(llama_dir[0], dtype=torch.float64, heads_file=path)


def random_heads_file(llama_dir, tmp_path_factory, **layout):
    """A heads file of random root-conditioned draft layers of that layout for the llama_dir model."""
    from tokenswift_trt.model.draft_layers import DraftLayers
    from tokenswift_trt.training.train_heads import save_heads

    engine = quiet_load(llama_dir[0], dtype=torch.float64)
    layers = DraftLayers(engine.config, 3, root_conditioned=True, **layout)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, value in layers.state_dict().items():
            if name == "vocab":  # a draft vocabulary: every third id of the model's
                value.copy_(torch.arange(value.numel()) * 3)
                continue
            value.copy_(
                torch.randn(value.shape, generator=generator) * (0.3 if "linear" in name else 0.05)
                + (1.0 if "norm" in name else 0.0)
            )
    path = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    save_heads(layers, path)
    return path


@pytest.fixture(scope="session")
def rooted_engine64(llama_dir, tmp_path_factory):
    """float64 engine whose random draft layers are root-conditioned (model/draft_layers.py)."""
    return _random_heads_engine64(llama_dir, tmp_path_factory)


@pytest.fixture(scope="session")
def vocab_engine64(llama_dir, tmp_path_factory):
    """float64 engine whose random root-conditioned draft layers have a draft vocabulary of 32 ids
    (every third id of the model's 96; model/draft_layers.VocabHead)."""
    return _random_heads_engine64(llama_dir, tmp_path_factory, vocab_size=32)


@pytest.fixture(scope="session")
def path_engine64(llama_dir, tmp_path_factory):
    """float64 engine whose random root-conditioned draft layers have a path input (depths >= 2
    drafted along each branch, model/draft_layers.PathInput)."""
    return _random_heads_engine64(llama_dir, tmp_path_factory, root_width=24, path_width=24)

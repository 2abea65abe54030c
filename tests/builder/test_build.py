"""Engine directories: manifest round trip, sha256 checks, bad inputs, atomic builds, CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from tokenswift_trt.backends.loader import load_engine_dir
from tokenswift_trt.builder.build import REPOSITORY, BuildError, BuildRequest, build_engine, resolve
from tokenswift_trt.builder.presets import PRESETS
from tokenswift_trt.cli import main
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.engine_dir import MANIFEST, EngineDirError, read_manifest
from tokenswift_trt.model.sampling import SamplingConfig

from helpers import PAPER_TREE

GREEDY = SamplingConfig(temperature=0)


@pytest.fixture
def checkpoint(llama_dir, tmp_path):
    """The tiny transformers Llama plus a tokenizer, as a user's checkpoint dir."""
    from tokenswift_trt.builder.random_model import byte_level_tokenizer

    directory = tmp_path / "ckpt"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((llama_dir[0] / name).read_bytes())
    tokenizer = byte_level_tokenizer()
    tokenizer.post_processor = None  # no BOS (id 256): this tiny model's vocabulary is 96
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_torch_engine_round_trip_and_same_tokens(checkpoint, tmp_path, llama_engine64):
    out = build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=tmp_path / "engine"))
    manifest = read_manifest(out)
    assert manifest.backend == "torch" and manifest.dtype == "float32" and not manifest.random_weights
    assert set(manifest.artifacts) == {"model/config.json", "model/model.safetensors", "model/tokenizer.json"}
    assert all(len(entry["sha256"]) == 64 for entry in manifest.artifacts.values())
    assert (out / "build.log").read_text().count("\n") >= 2
    engine, _ = load_engine_dir(out, dtype=torch.float64)
    prompt = list(range(3, 40))
    config = GenerationConfig(tree=PAPER_TREE, max_new_tokens=60, sampling=GREEDY, ignore_eos=True)
    assert generate(engine, prompt, config)[0] == generate(llama_engine64, prompt, config)[0]


def test_corrupt_and_mismatched_engines_are_refused(checkpoint, tmp_path):
    out = build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=tmp_path / "engine"))
    weights = out / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(EngineDirError, match="sha256"):
        read_manifest(out)
    weights.write_bytes(bytes(data[:-1]))
    with pytest.raises(EngineDirError, match="wrong size"):
        read_manifest(out)

    other = build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=tmp_path / "other"))
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["config"]["hidden_size"] = 128
    (other / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(EngineDirError, match="does not match"):
        read_manifest(other)
    (other / MANIFEST).write_text("{not json")
    with pytest.raises(EngineDirError, match="corrupt"):
        read_manifest(other)
    with pytest.raises(EngineDirError, match="no tokenswift.json"):
        read_manifest(checkpoint)


def test_bad_build_inputs_have_clear_errors(checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENSWIFT_HOME", raising=False)
    with pytest.raises(BuildError, match="unknown model 'gpt-5'"):
        build_engine(BuildRequest(model="gpt-5", out=tmp_path / "x"))
    with pytest.raises(BuildError, match=r"\$TOKENSWIFT_HOME/llama3.1-8b.*--random-weights"):
        build_engine(BuildRequest(model="llama3.1-8b", out=tmp_path / "x"))
    monkeypatch.setenv("TOKENSWIFT_HOME", str(tmp_path / "home"))
    with pytest.raises(BuildError, match="home/qwen2.5-7b"):
        build_engine(BuildRequest(model="qwen2.5-7b", out=tmp_path / "x"))
    with pytest.raises(BuildError, match="vocab_size=96, but llama3.1-8b has 128256"):
        build_engine(BuildRequest(model="llama3.1-8b", checkpoint=checkpoint, out=tmp_path / "x"))

    heads = {f"draft_layers.{i}.linear.weight": torch.zeros(32, 32) for i in range(3)}
    heads.update(
        {
            f"draft_layers.{i}.{n}.weight": torch.ones(32)
            for i in range(3)
            for n in ("input_layernorm", "post_layernorm")
        }
    )
    save_file(heads, str(tmp_path / "heads.safetensors"))
    with pytest.raises(BuildError, match="draft layers.*shape"):
        build_engine(
            BuildRequest(
                model=str(checkpoint),
                no_drafts=True,
                heads=tmp_path / "heads.safetensors",
                out=tmp_path / "x",
            )
        )
    assert not (tmp_path / "x").exists()  # failed builds leave nothing behind
    assert not list(tmp_path.glob(".x.building-*"))

    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(BuildError, match="unsupported architecture 'MistralForCausalLM'"):
        build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=tmp_path / "x"))


def test_the_bundled_preset_builds_from_this_repositorys_checkpoint(checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENSWIFT_HOME", raising=False)
    preset, found = resolve(BuildRequest(model="swift-tiny", out=tmp_path / "x"))
    assert preset.name == "swift-tiny" and found == REPOSITORY / "models" / "swift-tiny"
    assert (found / "model.safetensors").is_file()
    monkeypatch.setenv("TOKENSWIFT_HOME", str(tmp_path))  # a checkpoint there comes first
    shutil.copytree(checkpoint, tmp_path / "swift-tiny")
    assert resolve(BuildRequest(model="swift-tiny", out=tmp_path / "x"))[1] == tmp_path / "swift-tiny"


def test_existing_engine_needs_force(checkpoint, tmp_path):
    out = build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=tmp_path / "engine"))
    with pytest.raises(BuildError, match="--force"):
        build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=out))
    before = read_manifest(out).artifacts
    build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=out, force=True, dtype="bfloat16"))
    after = read_manifest(out)
    assert after.dtype == "bfloat16" and after.artifacts != before


def test_random_weights_preset_and_released_heads(checkpoint, tmp_path):
    out = build_engine(BuildRequest(model="swift-tiny", random_weights=True, out=tmp_path / "tiny"))
    manifest = read_manifest(out)
    assert manifest.random_weights and manifest.defaults == PRESETS["swift-tiny"].defaults
    engine, _ = load_engine_dir(out)
    assert engine.config.hidden_size == 256 and len(engine.draft_layers) == 3
    tensors = load_file(str(checkpoint / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    for i in range(3):  # a combined checkpoint in the released TokenSwift format
        tensors[f"model.medusa_layers.{i}.linear.weight"] = torch.randn(64, 64, generator=generator)
        tensors[f"model.medusa_layers.{i}.input_layernorm.weight"] = torch.ones(64)
        tensors[f"model.medusa_layers.{i}.post_layernorm.weight"] = torch.ones(64)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    built = build_engine(BuildRequest(model=str(checkpoint), no_drafts=True, out=tmp_path / "with-heads"))
    assert "model/heads.safetensors" in read_manifest(built).artifacts
    engine, _ = load_engine_dir(built)
    assert engine.trained_draft_layers
    assert torch.equal(
        engine.draft_layers.layers[1].linear.weight, tensors["model.medusa_layers.1.linear.weight"]
    )


def test_a_checkpoint_without_draft_layers_is_refused_unless_asked_for(checkpoint, tmp_path):
    """Building, then serving, a model whose TokenSwift would run at AR speed stops in one line that
    names the ways out; --no-drafts builds it."""
    runner = CliRunner()
    refused = runner.invoke(main, ["build", "--model", str(checkpoint), "--out", str(tmp_path / "engine")])
    assert refused.exit_code == 2 and not (tmp_path / "engine").exists()
    line = refused.stderr.strip()
    assert "has no draft layers, so TokenSwift would run at AR speed" in line and "\n" not in line
    assert "--heads FILE" in line and "train-heads" in line and "--no-drafts" in line
    built = runner.invoke(
        main, ["build", "--no-drafts", "--model", str(checkpoint), "--out", str(tmp_path / "engine")]
    )
    assert built.exit_code == 0, built.output
    from tokenswift_trt.cli.common import CliError
    from tokenswift_trt.cli.serve import check_source

    with pytest.raises(CliError, match="has no draft layers.*serve it anyway with --no-drafts"):
        check_source(tmp_path / "engine", "cpu")
    check_source(tmp_path / "engine", "cpu", no_drafts=True)
    check_source(REPOSITORY / "models" / "swift-tiny", "cpu")  # it has its heads.safetensors


def test_cli_build_then_generate_with_engine(checkpoint, tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        main, ["build", "--no-drafts", "--model", str(checkpoint), "--out", str(tmp_path / "engine")]
    )
    assert result.exit_code == 0, result.output
    again = runner.invoke(
        main, ["build", "--no-drafts", "--model", str(checkpoint), "--out", str(tmp_path / "engine")]
    )
    assert again.exit_code == 2 and "--force" in again.stderr
    generated = runner.invoke(
        main,
        [
            "generate",
            "--engine",
            str(tmp_path / "engine"),
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "20",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
    )
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.stdout.splitlines()[-1])["new_tokens"] == 20
    missing = runner.invoke(
        main, ["generate", "--engine", str(tmp_path / "none"), "--prompt", "Hi", "--max-new-tokens", "5"]
    )
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    both = runner.invoke(
        main,
        [
            "generate",
            "--engine",
            str(tmp_path / "engine"),
            "--model-dir",
            str(checkpoint),
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "5",
        ],
    )
    assert both.exit_code == 2 and "exactly one of --model PRESET, --model-dir" in both.stderr
    trt = runner.invoke(
        main,
        [
            "build",
            "--no-drafts",
            "--model",
            str(checkpoint),
            "--out",
            str(tmp_path / "trt"),
            "--backend",
            "tensorrt",
        ],
    )
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert trt.exit_code == 2 and "tensorrt" in trt.stderr and not (tmp_path / "trt").exists()

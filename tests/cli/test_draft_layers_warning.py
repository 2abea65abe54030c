"""A model directory without draft layers is said in one line; a preset's directory drafts with the
preset's layers and samples with its settings whether it is named by `--model` or `--model-dir`."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from tokenswift_trt.builder.presets import MODEL_DIR_DEFAULTS, MODEL_DIR_HEADS, PRESETS, REPOSITORY
from tokenswift_trt.cli import main

SWIFT_TINY = REPOSITORY / "models/swift-tiny"
ARGS = ["--prompt", "It is a truth", "--max-new-tokens", "16", "--seed", "1", "--ignore-eos"]


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "has no draft layers" in line]


def test_a_model_directory_without_draft_layers_is_said_in_one_line_and_still_runs(tmp_path):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(SWIFT_TINY / name, tmp_path / name)
    result = CliRunner().invoke(main, ["generate", "--model-dir", str(tmp_path), *ARGS])
    assert result.exit_code == 0, result.output
    (line,) = _warnings(result.stderr)
    assert line.startswith(f"warning: {tmp_path} has no draft layers ({MODEL_DIR_HEADS})")
    assert f"tokenswift-trt train-heads --model-dir {tmp_path}" in line
    assert "16 tokens" in result.stderr  # the generation ran

    with_layers = CliRunner().invoke(main, ["generate", "--model-dir", str(SWIFT_TINY), *ARGS])
    assert with_layers.exit_code == 0 and not _warnings(with_layers.stderr), with_layers.output


@pytest.mark.slow
def test_the_smollm2_directory_and_the_preset_draft_alike():
    directory = REPOSITORY / PRESETS["smollm2-135m"].bundled
    if not (directory / "config.json").is_file():
        pytest.skip("models/smollm2-135m is not prepared here (`make models`)")
    if not (directory / MODEL_DIR_HEADS).is_file() or not (directory / MODEL_DIR_DEFAULTS).is_file():
        pytest.skip("models/smollm2-135m lacks its draft layers or settings: rerun `make models`")
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    common = [
        "--prompt", prompt, "--max-new-tokens", "64", "--seed", "3", "--ignore-eos", "--tree", "3,3,3",
        "--json",
    ]  # fmt: skip
    reports = []
    for source in (["--model", "smollm2-135m"], ["--model-dir", str(directory)]):  # the same settings
        result = CliRunner().invoke(main, ["generate", *source, *common])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(result.stdout.strip().splitlines()[-1]))
    by_name, by_dir = reports
    assert by_name["acceptance_rate"] > 0  # the trained layers draft
    assert by_dir["acceptance_rate"] == by_name["acceptance_rate"]
    assert by_dir["token_ids"] == by_name["token_ids"]

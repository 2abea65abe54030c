"""A model directory that records its preset's settings (`tokenswift_defaults.json`, written by
`make models`) samples with them under `--model-dir`, as `--model PRESET` does; flags override them."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from tokenswift_trt.builder.presets import MODEL_DIR_DEFAULTS, PRESETS, REPOSITORY, write_model_defaults
from tokenswift_trt.cli import main

SWIFT_TINY = REPOSITORY / "models/swift-tiny"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "heads.safetensors")
ARGS = ["--prompt", "It is a truth", "--max-new-tokens", "24", "--seed", "1", "--ignore-eos", "--json"]


@pytest.fixture
def recorded_dir(tmp_path):
    for name in FILES:
        shutil.copyfile(SWIFT_TINY / name, tmp_path / name)
    write_model_defaults(PRESETS["swift-tiny"], tmp_path)
    return tmp_path


def _tokens(*args: str) -> list[int]:
    result = CliRunner().invoke(main, ["generate", *args, *ARGS])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]


def test_a_directory_with_recorded_settings_samples_as_its_preset_and_a_flag_overrides_them(recorded_dir):
    recorded = json.loads((recorded_dir / MODEL_DIR_DEFAULTS).read_text())
    assert recorded == {"preset": "swift-tiny", "defaults": PRESETS["swift-tiny"].defaults}

    by_name = _tokens("--model", "swift-tiny")
    assert _tokens("--model-dir", str(recorded_dir)) == by_name
    assert _tokens("--model-dir", str(SWIFT_TINY)) != by_name  # records nothing: the runtime's own settings

    no_penalty = _tokens("--model-dir", str(recorded_dir), "--penalty", "1")
    assert no_penalty == _tokens("--model", "swift-tiny", "--penalty", "1") != by_name


@pytest.mark.parametrize(
    "content",
    [
        '{"defaults": {"min_p": 0.1,',
        '["min_p"]',
        '{"defaults": {"min_pp": 0.1}}',
        '{"defaults": {"penalty": 0.5}}',
    ],
    ids=["not-json", "not-an-object", "unknown-setting", "bad-value"],
)
def test_a_malformed_settings_file_is_one_line_naming_it(recorded_dir, content):
    path = recorded_dir / MODEL_DIR_DEFAULTS
    path.write_text(content)
    result = CliRunner().invoke(main, ["generate", "--model-dir", str(recorded_dir), *ARGS])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tokenswift-trt: error: ") and str(path) in line and "fix it or delete it" in line

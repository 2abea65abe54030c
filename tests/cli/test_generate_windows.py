"""`generate --json` carries the figures per window of output positions (`Stats.windows`)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("random-tiny"), seed=1)


def _generate_json(model_dir, new_tokens: int, *extra: str) -> dict:
    args = ["generate", "--model-dir", str(model_dir), "--prompt", "Hello there"]
    args += ["--max-new-tokens", str(new_tokens)]
    result = CliRunner().invoke(main, [*args, "--temperature", "0", "--ignore-eos", "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_json_reports_windows_of_256_positions_covering_the_output(model_dir):
    report = _generate_json(model_dir, 300, "--method", "ar")
    windows = report["windows"]
    assert report["window_tokens"] == 256
    assert [(w["start"], w["end"]) for w in windows] == [(0, 256), (256, 512)]
    assert sum(w["tokens"] for w in windows) == report["new_tokens"] - 1 == 299  # all but the prefill's
    assert [w["iterations"] for w in windows] == [255, 44]  # AR: one token per iteration, nothing drafted
    assert all(w["tokens_per_iteration"] == 1.0 and w["drafted_tokens"] == 0 for w in windows)


def test_generate_json_windows_carry_tokenswifts_acceptance(model_dir):
    report = _generate_json(model_dir, 64, "--tree", "3,3", "--ngram-topk", "4")
    (window,) = report["windows"]
    assert window["tokens"] == report["new_tokens"] - 1 == 63
    assert window["tokens_per_iteration"] == pytest.approx(window["tokens"] / window["iterations"])
    assert len(window["alpha_by_depth"]) == len(window["reached_by_depth"]) >= 2
    assert window["drafted_tokens"] > 0
    assert report["acceptance_rate"] == pytest.approx(window["accepted_tokens"] / window["drafted_tokens"])

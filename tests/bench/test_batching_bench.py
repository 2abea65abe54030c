"""`bench-batching` on swift-tiny: every setup answers every level, with each request's own text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenswift_trt.cli import main

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"


@pytest.mark.slow
def test_bench_batching_measures_every_setup_with_the_single_runs_text(tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
    from tokenswift_trt.serving.server import _bundled

    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    out = tmp_path / "batching"
    result = CliRunner().invoke(
        main,
        [
            "bench-batching",
            "--engine",
            str(MODEL),
            "--tokens",
            "24",
            "--concurrency",
            "1,3",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "batching.json").read_text())
    assert report["meta"]["cpu"] and report["meta"]["date"] and report["meta"]["tokens_per_request"] == 24
    assert len(report["rows"]) == 8  # four setups, two levels
    for row in report["rows"]:
        assert row["requests_completed"] == row["concurrency"] and not row["failures"]
        assert all(row["same_text_as_single_run"])
        assert row["aggregate_tokens_per_s"] > 0
    assert "batched TokenSwift" in (out / "batching.md").read_text()

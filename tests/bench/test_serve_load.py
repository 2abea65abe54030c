"""`bench-serve`: the load test's accounting checks, its report, and a small run on a real server."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenswift_trt.bench import serve_load
from tokenswift_trt.bench.serve_load import (
    Endpoints,
    LoadConfig,
    LoadResult,
    MemorySnapshot,
    RequestRecord,
    checks,
    metric_total,
    parse_metrics,
)
from tokenswift_trt.cli import main

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"

METRICS = """# HELP tokenswift:request_success_total Requests by outcome (ok, error, cancelled)
# TYPE tokenswift:request_success_total counter
tokenswift:request_success_total{model="tokenswift",outcome="ok"} 7
tokenswift:request_success_total{model="tokenswift",outcome="error"} 2
tokenswift:request_success_total{model="tokenswift",outcome="cancelled"} 3
tokenswift:request_success_total{model="other",outcome="ok"} 100
nv_inference_pending_request_count{model="tokenswift",version="1"} 0
"""


def test_metrics_are_parsed_and_summed_by_label():
    samples = parse_metrics(METRICS)
    assert len(samples) == 5
    assert metric_total(samples, "tokenswift:request_success_total", model="tokenswift") == 12
    assert metric_total(samples, "tokenswift:request_success_total", outcome="ok") == 107
    assert metric_total(samples, "nv_inference_pending_request_count", model="tokenswift") == 0


def _result(counted: float, pending: float = 0.0) -> tuple[LoadResult, dict]:
    config = LoadConfig(streams=1, stream_tokens=4, short_requests=1, short_tokens=2)
    records = [
        RequestRecord("stream", "grpc", "ok", tokens=4, chunks=2, ttft_s=0.1, duration_s=1),
        RequestRecord("short", "http", "ok", tokens=2, chunks=2, ttft_s=0.2, duration_s=0.3),
    ]
    zero = {"outcome_ok": 0.0, "outcome_error": 0.0, "outcome_cancelled": 0.0}
    metrics = {**zero, "outcome_ok": counted, "generation_tokens": 6.0}
    memory = [MemorySnapshot("before", 2, 400.0, 1.0, 1), MemorySnapshot("after", 2, 410.0, 1.0, 1)]
    final = {"pending": pending, "has_pending": 1.0}
    return LoadResult(config, {}, 1.0, records, metrics, memory), final


def test_the_checks_pass_when_every_request_is_answered_and_accounted_for():
    result, final = _result(counted=2.0)
    found = {check.name: check.status for check in checks(result, final)}
    assert found == {"answers": "pass", "accounted": "pass", "tokens": "pass", "pending": "pass"}


def test_the_checks_fail_for_a_lost_request_a_pending_one_and_a_request_cut_short():
    result, final = _result(counted=1.0, pending=1.0)
    found = {check.name: check for check in checks(result, final)}
    assert found["accounted"].status == "fail" and "grew by 1 " in found["accounted"].detail
    assert found["pending"].status == "fail"
    result, final = _result(counted=2.0)
    result.requests[1].tokens = 1  # a short request cut short
    found = {check.name: check for check in checks(result, {**final, "has_pending": 0.0})}
    assert (found["answers"].status, found["tokens"].status) == ("fail", "fail")
    assert "1/2 requests got every token" in found["answers"].detail
    assert found["pending"].status == "skipped"


def test_a_failed_check_exits_1_with_one_line_and_still_writes_the_report(tmp_path, monkeypatch):
    result, final = _result(counted=1.0)
    result.checks = checks(result, final)
    monkeypatch.setattr(serve_load, "check_reachable", lambda endpoints: None)
    monkeypatch.setattr(serve_load, "run_meta", lambda command, endpoints: {"command": command})
    monkeypatch.setattr(serve_load, "run_load", lambda config, endpoints, meta, progress: result)
    urls = ["--grpc-url", "127.0.0.1:1", "--http-url", "127.0.0.1:1", "--metrics-url", "http://127.0.0.1:1/m"]
    outcome = CliRunner().invoke(main, ["bench-serve", *urls, "--out", str(tmp_path)])
    assert outcome.exit_code == 1
    assert (
        outcome.stderr.strip().splitlines()[-1].startswith("tokenswift-trt: error: check failed: accounted:")
    )
    assert "Traceback" not in outcome.output
    assert json.loads((tmp_path / "serve_load.json").read_text())["passed"] is False


@pytest.mark.parametrize(
    "args,message",
    [
        (["--grpc-url", "127.0.0.1:1"], "needs all of --grpc-url, --http-url and --metrics-url"),
        (
            ["--grpc-url", "127.0.0.1:1", "--http-url", "127.0.0.1:1", "--metrics-url", "127.0.0.1:1"],
            "must be a URL",
        ),
        (
            [
                "--grpc-url",
                "127.0.0.1:1",
                "--http-url",
                "127.0.0.1:1",
                "--metrics-url",
                "http://127.0.0.1:1/",
            ],
            "no server answers HTTP at 127.0.0.1:1",
        ),
        (["--engine", "/nonexistent/engine"], "does not exist"),
        (["--streams", "0"], "--streams"),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path):
    outcome = CliRunner().invoke(main, ["bench-serve", *args, "--out", str(tmp_path)])
    assert outcome.exit_code == 2, outcome.output
    lines = outcome.stderr.strip().splitlines()
    assert (
        message in lines[-1]
        and lines[-1].startswith("tokenswift-trt: error:")
        and "Traceback" not in outcome.output
    )
    assert not (tmp_path / "serve_load.json").exists()


@pytest.mark.slow
def test_a_small_load_run_accounts_for_every_request(tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="the load test needs tritonclient[all]")
    pytest.importorskip("psutil", reason="the load test reads memory with psutil")
    from tokenswift_trt.serving.server import _bundled

    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    args = ["--engine", str(MODEL), "--streams", "2", "--stream-tokens", "32", "--short-requests", "4"]
    args += ["--short-tokens", "8", "--settle", "1"]
    outcome = CliRunner().invoke(main, ["bench-serve", *args, "--out", str(tmp_path)])
    assert outcome.exit_code == 0, outcome.output
    document = json.loads((tmp_path / "serve_load.json").read_text())
    assert document["passed"] and {c["status"] for c in document["checks"]} == {"pass"}
    assert document["by_kind"]["stream"]["requests"] == 2 and document["by_kind"]["short"]["requests"] == 4
    assert document["client_tokens"] == document["server"]["generation_tokens"] == 2 * 32 + 4 * 8
    assert document["tokens_per_s"] > 0 and document["all"]["ttft_p95_s"] >= document["all"]["ttft_p50_s"] > 0
    # every request is counted once by the server, as ok
    assert document["server"]["outcome_ok"] == 6 and document["all"]["outcomes"] == {"ok": 6}
    assert [m["label"] for m in document["memory"]] == ["before", "after"]
    assert all(m["processes"] >= 2 and m["rss_mib"] > 0 for m in document["memory"])  # server and stub
    with open(tmp_path / "requests.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 6
    summary = (tmp_path / "serve_load.md").read_text()
    assert "checks: all passed" in summary and "tokenswift-trt bench-serve" in summary
    assert document["meta"]["torch"] and document["meta"]["date"]


def test_endpoints_and_config_are_dataclasses_with_checked_values():
    with pytest.raises(ValueError, match="streams"):
        LoadConfig(streams=0)
    assert Endpoints("a:1", "a:2", "http://a:3/metrics").server_pid is None

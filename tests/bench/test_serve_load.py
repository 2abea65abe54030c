"""`bench-serve`: the load test's accounting and leak checks, its report, and a small run on a real server."""

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
    PhaseResult,
    RequestRecord,
    checks,
    metric_total,
    mixed_plan,
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


def test_the_mixed_phase_holds_each_kind_in_its_share_in_a_seeded_order():
    plan = mixed_plan(LoadConfig(mixed_requests=100))
    counts = {kind: plan.count(kind) for kind in set(plan)}
    assert counts == {"complete-grpc": 25, "complete-http": 25, "cancel": 20, "disconnect": 15, "bad": 15}
    assert plan == mixed_plan(LoadConfig(mixed_requests=100)) != mixed_plan(LoadConfig(seed=2))
    assert len(mixed_plan(LoadConfig(mixed_requests=20))) == 20


def _result(counted: float, rss_after_mixed: float, shm_after_mixed: float = 1.0) -> tuple[LoadResult, dict]:
    config = LoadConfig(streams=1, stream_tokens=4, short_requests=0, mixed_requests=2, mixed_tokens=4)
    load = [RequestRecord("load", "stream", "grpc", True, "ok", tokens=4, chunks=2, ttft_s=0.1, duration_s=1)]
    mixed = [
        RequestRecord(
            "mixed", "complete", "http", True, "ok", tokens=4, chunks=1, ttft_s=0.2, duration_s=0.2
        ),
        RequestRecord("mixed", "bad", "http", False, "error", detail="HTTP 400: not valid JSON"),
    ]
    zero = {"outcome_ok": 0.0, "outcome_error": 0.0, "outcome_cancelled": 0.0, "generation_tokens": 0.0}
    phases = [
        PhaseResult("load", 1.0, load, {**zero, "outcome_ok": 1.0, "generation_tokens": 4.0}),
        PhaseResult("mixed", 1.0, mixed, {**zero, "outcome_ok": counted, "generation_tokens": 4.0}),
    ]
    memory = [
        MemorySnapshot("before", 2, 400.0, 1.0, 1),
        MemorySnapshot("after_load", 2, 450.0, 1.0, 1),
        MemorySnapshot("after_mixed", 2, rss_after_mixed, shm_after_mixed, 1),
    ]
    final = {"pending": 0.0, "has_pending": 1.0}
    return LoadResult(config, {}, phases, memory), final


def test_the_checks_pass_when_everything_is_accounted_for_and_memory_holds():
    result, final = _result(counted=1.0, rss_after_mixed=450.0 + 63.0)
    found = {check.name: check.status for check in checks(result, final, memory_measured=True)}
    assert found == {
        "answers": "pass",
        "accounted": "pass",
        "load_tokens": "pass",
        "pending": "pass",
        "rss": "pass",
        "shm": "pass",
    }


def test_the_checks_fail_for_a_lost_request_a_pending_one_and_memory_grown_past_the_tolerance():
    result, final = _result(counted=0.0, rss_after_mixed=450.0 + 65.0, shm_after_mixed=70.0)
    found = {check.name: check for check in checks(result, {**final, "pending": 1.0}, memory_measured=True)}
    assert found["accounted"].status == "fail" and "grew by 1 " in found["accounted"].detail
    assert found["pending"].status == "fail"
    assert found["rss"].status == "fail" and "450.0 MiB after phase 1, 515.0 MiB" in found["rss"].detail
    assert found["shm"].status == "fail"
    result, final = _result(counted=1.0, rss_after_mixed=450.0)
    result.phases[1].requests[0].tokens = 3  # a completion cut short
    assert {c.name: c.status for c in checks(result, final, memory_measured=False)} == {
        "answers": "fail",
        "accounted": "pass",
        "load_tokens": "pass",
        "pending": "pass",
        "rss": "skipped",
        "shm": "skipped",
    }


def test_a_failed_check_exits_1_with_one_line_and_still_writes_the_report(tmp_path, monkeypatch):
    result, final = _result(counted=1.0, rss_after_mixed=900.0)
    result.checks = checks(result, final, memory_measured=True)
    monkeypatch.setattr(serve_load, "check_reachable", lambda endpoints: None)
    monkeypatch.setattr(serve_load, "run_meta", lambda command, endpoints: {"command": command})
    monkeypatch.setattr(serve_load, "run_load", lambda config, endpoints, meta, progress: result)
    urls = ["--grpc-url", "127.0.0.1:1", "--http-url", "127.0.0.1:1", "--metrics-url", "http://127.0.0.1:1/m"]
    outcome = CliRunner().invoke(main, ["bench-serve", *urls, "--out", str(tmp_path)])
    assert outcome.exit_code == 1
    assert outcome.stderr.strip().splitlines()[-1].startswith("tokenswift-trt: error: check failed: rss:")
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
def test_a_small_load_run_accounts_for_every_request_and_leaks_nothing(tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="the load test needs tritonclient[all]")
    pytest.importorskip("psutil", reason="the load test reads memory with psutil")
    from tokenswift_trt.serving.server import _bundled

    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    args = ["--engine", str(MODEL), "--streams", "2", "--stream-tokens", "32", "--short-requests", "4"]
    args += ["--short-tokens", "8", "--mixed-requests", "20", "--mixed-tokens", "32", "--settle", "1"]
    outcome = CliRunner().invoke(main, ["bench-serve", *args, "--out", str(tmp_path)])
    assert outcome.exit_code == 0, outcome.output
    document = json.loads((tmp_path / "serve_load.json").read_text())
    assert document["passed"] and {c["status"] for c in document["checks"]} == {"pass"}
    load, mixed = document["phases"]
    assert load["by_kind"]["stream"]["requests"] == 2 and load["by_kind"]["short"]["requests"] == 4
    assert load["client_tokens"] == load["server"]["generation_tokens"] == 2 * 32 + 4 * 8
    assert load["tokens_per_s"] > 0 and load["all"]["ttft_p95_s"] >= load["all"]["ttft_p50_s"] > 0
    kinds = {kind: summary["requests"] for kind, summary in mixed["by_kind"].items()}
    assert kinds == {"complete": 10, "cancel": 4, "disconnect": 3, "bad": 3}
    assert mixed["by_kind"]["complete"]["outcomes"] == {"ok": 10}
    assert mixed["by_kind"]["bad"]["outcomes"] == {"error": 3}
    # every request that reached the model is counted once by the server, by outcome
    for phase in (load, mixed):
        server = phase["server"]
        counted = server["outcome_ok"] + server["outcome_error"] + server["outcome_cancelled"]
        assert counted == phase["reached_model"]
    assert mixed["reached_model"] == 20 - 2  # two of the three bad requests stop at the HTTP front
    assert mixed["server"]["outcome_error"] == 1
    assert mixed["server"]["outcome_cancelled"] >= 1  # the cancels (a short stream may finish first)
    assert [m["label"] for m in document["memory"]] == ["before", "after_load", "after_mixed"]
    assert all(m["processes"] >= 2 and m["rss_mib"] > 0 for m in document["memory"])  # server and stub
    with open(tmp_path / "requests.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 26
    summary = (tmp_path / "serve_load.md").read_text()
    assert "checks: all passed" in summary and "tokenswift-trt bench-serve" in summary
    assert document["meta"]["torch"] and document["meta"]["date"]


def test_endpoints_and_config_are_dataclasses_with_checked_values():
    with pytest.raises(ValueError, match="streams"):
        LoadConfig(streams=0)
    assert Endpoints("a:1", "a:2", "http://a:3/metrics").server_pid is None

"""`batch`: a file of requests decoded together, results as JSON Lines, each request's text its own
`generate` run's; a run killed with SIGKILL resumes to the same results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import tokenswift_trt as ts
from tokenswift_trt.cli import main

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
REQUESTS = [
    {"id": "fox", "prompt": "Once upon a time there was a little fox", "max_new_tokens": 90, "seed": 3},
    {
        "id": "mill",
        "prompt": "The river ran past the mill",
        "max_new_tokens": 60,
        "temperature": 0,
        "method": "ar",
    },
    {"id": "king", "prompt": "In the morning the king said", "max_new_tokens": 120, "seed": 5, "tree": "3,3"},
]


@pytest.fixture(scope="module")
def tiny():
    return ts.load(model_dir=MODEL)


def _expected(model, request: dict) -> str:
    settings = {k: v for k, v in request.items() if k not in ("id", "prompt", "max_new_tokens")}
    return ts.generate(model, request["prompt"], request["max_new_tokens"], ignore_eos=True, **settings).text


def _write(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps({**r, "ignore_eos": True}) + "\n" for r in requests))
    return path


def _results(path: Path) -> dict[str, dict]:
    return {record["id"]: record for record in map(json.loads, path.read_text().splitlines())}


def test_batch_writes_each_requests_own_text(tiny, tmp_path):
    requests = _write(tmp_path / "requests.jsonl", REQUESTS)
    out = tmp_path / "results.jsonl"
    result = CliRunner().invoke(
        main,
        [
            "batch",
            "--model-dir",
            str(MODEL),
            "--input",
            str(requests),
            "--output",
            str(out),
            "--max-batch",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    results = _results(out)
    assert set(results) == {r["id"] for r in REQUESTS}
    for request in REQUESTS:
        record = results[request["id"]]
        assert record["status"] == "finished"
        assert record["text"] == _expected(tiny, request)
        assert record["new_tokens"] == request["max_new_tokens"]
    again = CliRunner().invoke(
        main, ["batch", "--model-dir", str(MODEL), "--input", str(requests), "--output", str(out)]
    )
    assert again.exit_code == 0 and "3 of 3 requests already" in again.output
    assert len(out.read_text().splitlines()) == 3  # nothing run twice


def test_a_batch_killed_with_sigkill_resumes_to_the_same_results(tiny, tmp_path):
    long = [{**r, "max_new_tokens": r["max_new_tokens"] * 8} for r in REQUESTS]
    requests = _write(tmp_path / "requests.jsonl", long)
    out = tmp_path / "results.jsonl"
    command = [sys.executable, "-m", "tokenswift_trt", "batch", "--model-dir", str(MODEL)]
    command += ["--input", str(requests), "--output", str(out), "--max-batch", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journals = Path(str(out) + ".journals")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # killed once some tokens of every running request are journaled
        if journals.is_dir() and sum(p.stat().st_size for p in journals.glob("*.journal")) > 2000:
            break
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    unfinished = len(out.read_text().splitlines()) if out.exists() else 0
    assert unfinished < len(long)  # it was killed mid-batch
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    results = _results(out)
    for request in long:
        assert results[request["id"]]["text"] == _expected(tiny, request), request["id"]


def test_bad_request_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "max_new_tokens": 4}\n{"max_new_tokens": 4}\n')
    result = CliRunner().invoke(
        main, ["batch", "--model-dir", str(MODEL), "--input", str(bad), "--output", str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code == 2
    assert 'bad.jsonl:2: each line needs a "prompt"' in result.output
    assert "Traceback" not in result.output


def test_torchrun_ranks_share_the_requests_and_rank_0_gathers_them(tiny, tmp_path):
    """Two torchrun ranks (gloo on the CPU) each decode every other request; the merged output holds
    each request's own text once, in the requests' order, and no rank file is left. A rank file left
    by an interrupted run counts as done on the next run, whatever its number of ranks."""
    requests = [*REQUESTS, {"id": "sea", "prompt": "The sea was calm", "max_new_tokens": 50, "seed": 9}]
    path = _write(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "results.jsonl"
    # a run of 3 ranks was interrupted after rank 1 finished "mill": its file is merged, not redone
    (tmp_path / "results.jsonl.rank1-of-3").write_text(
        json.dumps({"id": "mill", "status": "finished", "text": "kept", "token_ids": [], "new_tokens": 0})
        + "\n"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*torchrun, "-m", "tokenswift_trt", "batch", "--model-dir", str(MODEL), "--input", str(path)]
    result = subprocess.run(
        [*command, "--output", str(out), "--max-batch", "2"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "results of 2 ranks merged into" in result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [record["id"] for record in lines] == ["fox", "mill", "king", "sea"]
    for request, record in zip(requests, lines, strict=True):
        expected = "kept" if request["id"] == "mill" else _expected(tiny, request)
        assert record["text"] == expected, request["id"]
    assert not list(tmp_path.glob("results.jsonl.rank*"))

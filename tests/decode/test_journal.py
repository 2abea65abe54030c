"""Journals: torn records are ignored; a killed generation resumes to the uninterrupted output."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from tokenswift_trt.decode.journal import JournalError, JournalWriter, read_journal, truncate_to_valid

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
CLI = [sys.executable, "-m", "tokenswift_trt.cli"]
ARGS = [
    "--model-dir",
    str(MODEL),
    "--prompt",
    "It is a truth universally acknowledged",
    "--max-new-tokens",
    "700",
    "--min-p",
    "0.1",
    "--penalty",
    "1.2",
    "--penalty-window",
    "64",
    "--ignore-eos",
    "--json",
]


def test_records_round_trip_and_a_torn_tail_is_ignored(tmp_path):
    path = tmp_path / "run.journal"
    writer = JournalWriter(path, {"prompt_ids": [1, 2], "settings": {"seed": 5}}, every=3)
    writer.add([10, 11])
    writer.add([12, 13])  # 4 >= 3: one record
    writer.add([14])
    writer.close(finished=False)  # flushes [14]
    state = read_journal(path)
    assert (
        state.tokens == [10, 11, 12, 13, 14] and state.header["settings"]["seed"] == 5 and not state.finished
    )
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # a crash mid-write
    torn = read_journal(path)
    assert torn.tokens == [10, 11, 12, 13] and torn.dropped_records == 1
    truncate_to_valid(path)
    JournalWriter(path).close(finished=True)
    assert read_journal(path).finished and read_journal(path).dropped_records == 0
    assert not state.earlier_sampler
    older = tmp_path / "older.journal"
    first, rest = data.split(b"\n", 1)
    payload = first.rsplit(b"\t", 1)[0].replace(b"tokenswift-journal/2", b"tokenswift-journal/1")
    older.write_bytes(payload + b"\t" + f"{zlib.crc32(payload):08x}".encode() + b"\n" + rest)
    assert read_journal(older).earlier_sampler and read_journal(older).tokens[:4] == [10, 11, 12, 13]
    (tmp_path / "bad.journal").write_text("hello\n")
    with pytest.raises(JournalError, match="not a tokenswift journal"):
        read_journal(tmp_path / "bad.journal")


def _run(*args: str) -> dict:
    result = subprocess.run([*CLI, "generate", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "mode",
    [["--seed", "3"], pytest.param(["--temperature", "0"], marks=pytest.mark.slow)],
    ids=["sampling", "greedy"],
)
def test_kill_9_then_resume_equals_the_uninterrupted_run(tmp_path, mode):
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip("models/swift-tiny is not in this checkout")
    whole = _run(*ARGS, *mode)
    journal = tmp_path / "run.journal"
    process = subprocess.Popen(
        [*CLI, "generate", *ARGS, *mode, "--journal", str(journal), "--journal-every", "16"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if journal.is_file() and len(read_journal(journal).tokens) >= 200:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    interrupted = read_journal(journal)
    assert 200 <= len(interrupted.tokens) < 700 and not interrupted.finished
    resumed = _run("--resume", str(journal), "--json")
    assert resumed["token_ids"] == whole["token_ids"] and resumed["text"] == whole["text"]
    assert read_journal(journal).finished
    again = _run("--resume", str(journal), "--json")  # a finished journal just prints its text
    assert again["token_ids"] == whole["token_ids"]


def test_over_budget_request_is_refused_with_the_numbers(tmp_path):
    result = subprocess.run(
        [*CLI, "generate", *ARGS, "--memory-budget", "0.001"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert "not enough memory" in result.stderr and "GiB" in result.stderr and "positions" in result.stderr

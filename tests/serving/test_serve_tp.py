"""`serve --tp 2` on the CPU (gloo): a real tritonserver whose one model instance spans two ranks answers
as the single-process server does, concurrent requests batched; a worker rank killed mid-request
fails the requests in flight only, the server stays ready, the next request re-forms the group and
the journal resumes token for token."""

from __future__ import annotations

import os
import signal
import threading
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
from tokenswift_trt.serving.client import ClientError, generate_endpoint, grpc_generate  # noqa: E402
from tokenswift_trt.serving.server import TritonServer, _bundled, local_config  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
PROMPT = "It is a truth universally acknowledged, that a single man"
TP_TIMEOUT_S = 20.0


def _params(seed: int, max_tokens: int = 40, **extra) -> dict:
    return {
        "text_input": PROMPT,
        "max_tokens": max_tokens,
        "seed": seed,
        "min_p": 0.1,
        "ignore_eos": True,
        **extra,
    }


def _workers(server: TritonServer) -> list[int]:
    """Pids of the worker ranks (processes of the server's group running the worker entry)."""
    group = os.getpgid(server.process.pid)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            if b"_worker_main" in command and os.getpgid(int(entry.name)) == group:
                found.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return found


def _ready(server: TritonServer) -> bool:
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as response:
        return response.status == 200


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    config = local_config(MODEL)
    with TritonServer(config, log_path=tmp_path_factory.mktemp("single") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def journals(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("journals")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, journals):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    config = local_config(MODEL, journal_dir=journals, tp=2, tp_timeout=TP_TIMEOUT_S)
    with TritonServer(config, log_path=tmp_path_factory.mktemp("tp") / "server.log") as running:
        yield running


@pytest.mark.slow
def test_serve_tp_2_answers_http_and_grpc_streaming_as_one_process_does(single, sharded):
    expected = grpc_generate(single.grpc_url, _params(7, stream=True)).text
    assert len(_workers(sharded)) == 1
    streamed = grpc_generate(sharded.grpc_url, _params(7, stream=True))
    assert streamed.text == expected and streamed.chunks > 2
    assert generate_endpoint(sharded.http_url, _params(7), stream=False).text == expected
    assert grpc_generate(sharded.grpc_url, _params(7, tree="2,1")).text == expected


@pytest.mark.slow
def test_serve_tp_2_batches_concurrent_requests_each_as_one_process_answers_it(single, sharded):
    """Three streams at once on the two-rank instance: decoded together (every rank's scheduler in
    lockstep with rank 0's), each the text the single-process server gives it."""
    import time

    seeds = (3, 4, 5)
    expected = [grpc_generate(single.grpc_url, _params(seed, max_tokens=60)).text for seed in seeds]
    texts: dict[int, str] = {}
    first: dict[int, float] = {}
    ended: dict[int, float] = {}

    def run(index: int) -> None:
        params = _params(seeds[index], max_tokens=60, stream=True)
        on_text = lambda piece: first.setdefault(index, time.perf_counter())  # noqa: E731
        texts[index] = grpc_generate(sharded.grpc_url, params, on_text=on_text, timeout_s=300).text
        ended[index] = time.perf_counter()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert [texts.get(index) for index in range(3)] == expected
    assert max(first.values()) < min(ended.values())  # all three streamed before any finished
    assert len(_workers(sharded)) == 1


@pytest.mark.slow
def test_killing_a_worker_fails_that_request_then_serves_and_resumes(single, sharded, journals):
    from tokenswift_trt.decode.journal import read_journal

    expected = grpc_generate(single.grpc_url, _params(21, max_tokens=400)).text
    (worker,) = _workers(sharded)
    outcome: dict = {}

    def long_request() -> None:
        try:
            outcome["result"] = grpc_generate(
                sharded.grpc_url, _params(21, max_tokens=400, stream=True, request_id="tp-job"), timeout_s=300
            )
        except ClientError as error:
            outcome["error"] = str(error)

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    journal = journals / "tp-job.journal"
    for _ in range(2400):
        if journal.is_file() and len(read_journal(journal).tokens) >= 32:
            break
        threading.Event().wait(0.05)
    os.kill(worker, signal.SIGKILL)
    thread.join(TP_TIMEOUT_S + 60)
    assert not thread.is_alive()
    assert "tensor-parallel rank stopped" in outcome.get("error", ""), outcome
    assert "\n" not in outcome["error"].strip()
    interrupted = read_journal(journal)
    assert 32 <= len(interrupted.tokens) < 400 and not interrupted.finished
    assert _ready(sharded)

    resumed = grpc_generate(sharded.grpc_url, {"request_id": "tp-job", "resume": True, "stream": True})
    assert resumed.text == expected and read_journal(journal).finished
    (restarted,) = _workers(sharded)
    assert restarted != worker
    assert grpc_generate(sharded.grpc_url, _params(7, max_tokens=8)).text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "3"], "split into whole GQA groups for --tp 1, 2"),
        (["--tp", "2", "--instances", "2"], "drop --instances"),
        (["--tp", "2", "--device", "cuda:1"], "puts rank r on cuda:r: give --device cuda"),
    ],
)
def test_serve_tp_refuses_what_it_cannot_serve_in_one_line(args, message):
    from click.testing import CliRunner

    from tokenswift_trt.cli import main

    result = CliRunner().invoke(main, ["serve", "--engine", str(MODEL), *args])
    assert result.exit_code != 0 and message in result.output and result.exception.__class__ is SystemExit
    assert len(result.output.strip().splitlines()) == 1

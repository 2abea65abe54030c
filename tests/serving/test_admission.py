"""A real tritonserver under many clients: every request it takes finishes, one it cannot take now is
refused at once with 503 and Retry-After (never a reset connection), a request id another process runs
is refused as running elsewhere, a resume that changes its request is refused naming the field, and
the failures are counted by reason."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
openai = pytest.importorskip("openai", reason="the OpenAI front is tested with the openai client")

from tokenswift_trt.decode.journal import JournalLock  # noqa: E402
from tokenswift_trt.serving.http_front import HttpFront  # noqa: E402
from tokenswift_trt.serving.openai_api import OpenAIFrontend  # noqa: E402
from tokenswift_trt.serving.server import MODEL_REPO, TritonServer, _bundled, local_config  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
PROMPT = "It is a truth universally acknowledged, that a single man"
pytestmark = pytest.mark.slow


def _served(tmp_path: Path, **settings):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    config = local_config(MODEL, journal_dir=tmp_path / "journals", **settings)
    return TritonServer(config, log_path=tmp_path / "server.log")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, its HTTP front, its OpenAI front, journal folder): batches of 8, the default queue."""
    folder = tmp_path_factory.mktemp("admission")
    with (
        _served(folder, max_batch=8) as server,
        HttpFront("127.0.0.1", 0, server.http_url, MODEL_REPO / "tokenswift" / "config.pbtxt") as http,
        OpenAIFrontend(server.http_url, MODEL, port=0) as front,
    ):
        yield server, http, front, folder / "journals"


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def _failures(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        lines = response.read().decode().splitlines()
    found = {}
    for line in lines:
        if line.startswith("tokenswift:request_failure_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


def test_64_concurrent_openai_streams_three_times_all_finish_and_none_is_reset(served):
    _, _, front, _ = served
    client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=600)

    def stream(index: int) -> tuple[str, str]:
        try:
            pieces, reason = [], None
            for chunk in client.completions.create(
                model="swift-tiny",
                prompt=PROMPT,
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "method": "ar" if index % 2 else "tokenswift"},
            ):
                pieces.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            return "ok", "".join(pieces) if reason == "length" else f"finish_reason {reason}"
        except openai.APIStatusError as error:
            refused = error.status_code == 503 and error.response.headers.get("Retry-After")
            return ("refused" if refused else "error"), str(error)
        except openai.APIError as error:  # a reset or dropped connection
            return "error", f"{type(error).__name__}: {error}"

    outcomes = []
    for _ in range(3):
        with ThreadPoolExecutor(64) as pool:
            outcomes += list(pool.map(stream, range(64)))
    errors = [detail for kind, detail in outcomes if kind == "error"]
    assert not errors, errors[:3]
    texts = {detail for kind, detail in outcomes if kind == "ok"}
    assert len(texts) == 1, texts  # greedy: AR and TokenSwift, batched with anyone, write the same text
    assert sum(kind == "ok" for kind, _ in outcomes) == 192  # the queue (256) holds them all


def test_a_full_queue_answers_503_with_retry_after_on_every_front_and_counts_it(tmp_path):
    with (
        _served(tmp_path, max_batch=1, max_queue=1) as server,
        HttpFront("127.0.0.1", 0, server.http_url, MODEL_REPO / "tokenswift" / "config.pbtxt") as http,
        OpenAIFrontend(server.http_url, MODEL, port=0) as front,
    ):
        generate = f"http://{http.url}/v2/models/tokenswift/generate"
        body = {"text_input": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: _post(generate, body), range(6)))
        statuses = sorted(status for status, _, _ in answers)
        assert statuses.count(200) >= 2 and statuses.count(503) >= 1, statuses
        assert set(statuses) == {200, 503}
        for status, data, headers in answers:
            if status == 503:
                assert data["error"].startswith("server busy: ") and headers["Retry-After"] == "5", data
        busy = statuses.count(503)

        client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=600)

        def complete(_: int) -> str:
            try:
                client.completions.create(
                    model="swift-tiny",
                    prompt=PROMPT,
                    max_tokens=200,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                return "ok"
            except openai.APIStatusError as error:
                assert error.status_code == 503 and error.body["code"] == "server_busy", error.body
                assert error.response.headers["Retry-After"] == "5"
                return "busy"

        with ThreadPoolExecutor(6) as pool:
            kinds = list(pool.map(complete, range(6)))
        assert kinds.count("ok") >= 2 and kinds.count("busy") >= 1, kinds
        busy += kinds.count("busy")
        assert _failures(server.metrics_url).get("server_busy") == busy


def test_a_request_id_held_elsewhere_is_503_and_a_changed_resume_is_400(served):
    server, http, front, journals = served
    before = _failures(server.metrics_url)
    generate = f"http://{http.url}/v2/models/tokenswift/generate"
    lock = JournalLock(journals / "held.journal", holder="a test")  # another "server"
    status, data, headers = _post(generate, {"text_input": PROMPT, "max_tokens": 8, "request_id": "held"})
    assert status == 503 and headers.get("Retry-After"), data
    assert f"request_id held is being generated by a test (pid {os.getpid()} on" in data["error"]
    lock.release()

    client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=600)
    first = client.completions.create(
        model="swift-tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"request_id": "job", "ignore_eos": True},
    )
    again = client.completions.create(
        model="swift-tiny",  # the same request resumed: its finished journal's text
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"request_id": "job", "resume": True},
    )
    assert again.choices[0].text == first.choices[0].text
    with pytest.raises(openai.BadRequestError, match=r"which this one changes: temperature"):
        client.completions.create(
            model="swift-tiny",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0.5,
            extra_body={"request_id": "job", "resume": True},
        )
    status, data, _ = _post(
        generate, {"text_input": PROMPT, "max_tokens": 13, "request_id": "job", "resume": True}
    )
    assert status == 400 and "max_tokens (the journal's is 12)" in data["error"], data
    after = _failures(server.metrics_url)
    counted = {reason: after[reason] - before.get(reason, 0) for reason in after}
    assert counted.get("request_running_elsewhere") == 1 and counted.get("invalid_request") == 2


def test_many_clients_at_once_on_the_http_front_are_never_reset(served):
    """A burst of connections larger than a default listen backlog (5): each one is answered."""
    _, http, _, _ = served
    ready = f"http://{http.url}/v2/health/ready"
    barrier = threading.Barrier(64)

    def probe(_: int) -> int:
        barrier.wait(timeout=60)
        with urllib.request.urlopen(ready, timeout=120) as response:
            return response.status

    with ThreadPoolExecutor(64) as pool:
        assert list(pool.map(probe, range(64))) == [200] * 64

"""A real tritonserver on loopback serving swift-tiny: HTTP/gRPC, streaming, errors, load, cancel, metrics."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tokenswift_trt.cli import main

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
from tokenswift_trt.serving.client import ClientError, generate_endpoint, grpc_generate  # noqa: E402
from tokenswift_trt.serving.server import (  # noqa: E402
    ServerConfig,
    ServerError,
    TritonServer,
    _bundled,
    local_config,
)

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
PROMPT = "It is a truth universally acknowledged, that a single man"


def _free_ports(count: int) -> list[int]:
    from tokenswift_trt.serving.server import free_ports

    return free_ports(count)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    config = local_config(MODEL)
    with TritonServer(config, log_path=tmp_path_factory.mktemp("triton") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def front(server):
    """The published HTTP port of `serve`: generate bodies checked, everything relayed to Triton."""
    from tokenswift_trt.serving.http_front import HttpFront
    from tokenswift_trt.serving.server import MODEL_REPO

    config = MODEL_REPO / "tokenswift" / "config.pbtxt"
    with HttpFront("127.0.0.1", 0, server.http_url, config) as running:
        yield running


def _post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://{url}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read().removeprefix(b"data: "))
    except urllib.error.HTTPError as error:  # generate_stream words its error as one event
        return error.code, json.loads(error.read().removeprefix(b"data: "))


def _cli_text(seed: int, max_tokens: int) -> str:
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "--model-dir",
            str(MODEL),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            str(max_tokens),
            "--seed",
            str(seed),
            "--min-p",
            "0.1",
            "--ignore-eos",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1])["text"]


def _params(seed: int, max_tokens: int = 40, **extra) -> dict:
    return {
        "text_input": PROMPT,
        "max_tokens": max_tokens,
        "seed": seed,
        "min_p": 0.1,
        "ignore_eos": True,
        **extra,
    }


def test_every_endpoint_returns_the_cli_output_for_a_fixed_seed(server):
    expected = _cli_text(seed=7, max_tokens=40)
    streamed = grpc_generate(server.grpc_url, _params(7, stream=True))
    assert streamed.text == expected and streamed.chunks > 2
    whole = grpc_generate(server.grpc_url, _params(7, stream=False))
    assert whole.text == expected and whole.chunks == 1
    assert generate_endpoint(server.http_url, _params(7), stream=False).text == expected
    sse = generate_endpoint(server.http_url, _params(7), stream=True)
    assert sse.text == expected and sse.chunks > 2
    assert whole.stats["tokens_per_second"] > 0
    # `--tree auto` (the default) may settle on AR steps for 40 tokens (timing decides): a fixed tree
    # always drafts, and gives the same text (every plan is lossless)
    fixed = grpc_generate(server.grpc_url, _params(7, stream=False, tree="2,1"))
    assert fixed.text == expected
    stats = fixed.stats
    assert (
        0 <= stats["acceptance_rate"] <= 1
        and stats["total_draft_tokens"] > 0
        and stats["tokens_per_second"] > 0
    )
    assert stats["acceptance_rate"] == pytest.approx(
        stats["total_accepted_draft_tokens"] / stats["total_draft_tokens"]
    )
    ar = grpc_generate(server.grpc_url, _params(7, method="ar"))
    assert ar.text == expected and ar.stats["total_draft_tokens"] == 0


BAD_REQUESTS = [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "   ", "max_tokens": 8}, "empty"),
    ({"text_input": PROMPT, "max_tokens": 0}, "max_tokens must be positive"),
    ({"text_input": PROMPT, "max_tokens": -5}, "max_tokens must be positive"),
    ({"text_input": PROMPT, "max_tokens": 40000}, "maximum length"),
    ({"text_input": PROMPT, "max_tokens": 8, "temperature": -1.0}, "temperature"),
    ({"text_input": PROMPT, "max_tokens": 8, "top_p": 1.5}, "top-p"),
    ({"text_input": PROMPT, "max_tokens": 8, "repetition_penalty": 0.5}, "penalty"),
    ({"text_input": PROMPT, "max_tokens": 8, "method": "beam"}, "method"),
]


@pytest.mark.slow
@pytest.mark.parametrize("params,match", BAD_REQUESTS)
def test_bad_requests_get_errors_and_the_server_stays_healthy(server, params, match):
    with pytest.raises(ClientError, match=match):
        grpc_generate(server.grpc_url, params)
    with pytest.raises(ClientError, match=match):
        generate_endpoint(server.http_url, params, stream=False)
    assert grpc_generate(server.grpc_url, _params(1, max_tokens=8)).text


@pytest.mark.slow
def test_wrong_dtypes_and_non_utf8_bytes_are_refused(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses = []
    client.start_stream(callback=lambda result, error: responses.append(error))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"\xff\xfe not utf-8"], dtype=np.object_))
    wrong = grpcclient.InferInput("max_tokens", [1], "FP32")  # declared INT32
    wrong.set_data_from_numpy(np.array([8.0], dtype=np.float32))
    client.async_stream_infer("tokenswift", [text, wrong])
    good_tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
    good_tokens.set_data_from_numpy(np.array([8], dtype=np.int32))
    client.async_stream_infer("tokenswift", [text, good_tokens])
    for _ in range(200):
        if len(responses) >= 2:
            break
        threading.Event().wait(0.05)
    client.stop_stream()
    client.close()
    messages = [str(error) for error in responses[:2]]
    assert "FP32" in messages[0] or "data type" in messages[0].lower()
    assert "UTF-8" in messages[1]
    assert grpc_generate(server.grpc_url, _params(2, max_tokens=8)).text


@pytest.mark.slow
def test_four_concurrent_streams_complete_with_correct_outputs(server):
    seeds = [11, 12, 13, 14]
    expected = {seed: _cli_text(seed, 32) for seed in seeds}
    results: dict[int, str] = {}
    failures: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            results[seed] = grpc_generate(
                server.grpc_url, _params(seed, max_tokens=32, stream=True), timeout_s=300
            ).text
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not failures and results == expected


@pytest.mark.slow
def test_cancel_mid_stream_then_serve_the_next_request(server):
    partial = grpc_generate(server.grpc_url, _params(5, max_tokens=3000, stream=True), cancel_after_chunks=3)
    assert partial.chunks == 3
    assert grpc_generate(server.grpc_url, _params(6, max_tokens=16)).text
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        metrics = response.read().decode()
    assert 'tokenswift:request_success_total{model="tokenswift",outcome="cancelled"} 1' in metrics


def test_missing_engine_is_a_clear_error_and_leaves_nothing_behind(tmp_path):
    server = TritonServer(ServerConfig(engine=tmp_path / "absent"))
    with pytest.raises(ServerError, match="does not exist"):
        server.start()
    assert not server.workdir.exists()  # the staging folder (backends copied first) is removed


@pytest.mark.slow
def test_kill_9_the_server_then_resume_by_request_id(tmp_path):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    from tokenswift_trt.decode.journal import read_journal

    expected = _cli_text(seed=21, max_tokens=500)
    journals = tmp_path / "journals"
    config = local_config(MODEL, journal_dir=journals, memory_budget_gib=0.05)
    first = TritonServer(config, log_path=tmp_path / "first.log").start()
    done = threading.Event()

    def long_request() -> None:
        try:
            grpc_generate(
                first.grpc_url, _params(21, max_tokens=500, stream=True, request_id="job-1"), timeout_s=120
            )
        except BaseException:  # the server dies under it
            pass
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    journal = journals / "job-1.journal"
    for _ in range(1200):
        if journal.is_file() and len(read_journal(journal).tokens) >= 100:
            break
        threading.Event().wait(0.05)
    first.kill()
    first.stop()
    interrupted = read_journal(journal)
    assert 100 <= len(interrupted.tokens) < 500 and not interrupted.finished

    with TritonServer(config, log_path=tmp_path / "second.log") as second:
        resumed = grpc_generate(second.grpc_url, {"request_id": "job-1", "resume": True, "stream": True})
        assert resumed.text == expected
        assert read_journal(journal).finished
        with pytest.raises(ClientError, match="no journal"):
            grpc_generate(second.grpc_url, {"request_id": "unknown", "resume": True})
        with pytest.raises(ClientError, match="request_id"):
            grpc_generate(second.grpc_url, {**_params(1, max_tokens=4), "request_id": "../etc/passwd"})
        with pytest.raises(ClientError, match=r"not enough memory: .* GiB .*positions"):
            grpc_generate(second.grpc_url, _params(1, max_tokens=30000))  # over the 0.05 GiB budget
        assert grpc_generate(second.grpc_url, _params(1, max_tokens=8)).text  # and it keeps serving


def _scrape(server) -> dict[str, float]:
    """Prometheus text from the metrics port: 'name{labels}' -> value."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"
    }


@pytest.mark.slow
def test_metrics_add_up_after_known_requests(server):
    model = '{model="tokenswift"}'
    before = _scrape(server)
    drafted = grpc_generate(server.grpc_url, _params(31, max_tokens=24, tree="2,1", ngram_topk=0))
    plain = grpc_generate(server.grpc_url, _params(32, max_tokens=8, method="ar"))
    with pytest.raises(ClientError):
        grpc_generate(server.grpc_url, _params(33, max_tokens=0))
    cancelled = grpc_generate(
        server.grpc_url, _params(34, max_tokens=3000, stream=True, method="ar"), cancel_after_chunks=3
    )
    assert cancelled.chunks == 3
    threading.Event().wait(1.0)  # the cancelled request ends at its next iteration
    after = _scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt = drafted.stats["prompt_tokens"]
    assert plain.stats["prompt_tokens"] == prompt > 0
    assert delta(f"tokenswift:prompt_tokens_total{model}") == 3 * prompt  # the refused one never started
    streamed = delta(f"tokenswift:generation_tokens_total{model}") - 24 - 8
    assert drafted.stats["completion_tokens"] == 24 and plain.stats["completion_tokens"] == 8
    assert 3 <= streamed < 3000  # the cancelled request's tokens, counted as they streamed
    draft_tokens = delta(f"tokenswift:spec_decode_num_draft_tokens_total{model}")
    assert draft_tokens == drafted.stats["total_draft_tokens"]
    accepted = delta(f"tokenswift:spec_decode_num_accepted_tokens_total{model}")
    assert accepted == drafted.stats["total_accepted_draft_tokens"]
    per_position = [
        delta(
            f'tokenswift:spec_decode_num_accepted_tokens_per_pos_total{{model="tokenswift",position="{i}"}}'
        )
        for i in range(16)
    ]
    assert sum(per_position) == accepted and per_position[2:] == [0] * 14  # tree 2,1: two draft depths
    drafts = delta(f"tokenswift:spec_decode_num_drafts_total{model}")
    assert 0 < drafts and drafts * 2 == drafted.stats["total_draft_tokens"]
    outcome = 'tokenswift:request_success_total{{model="tokenswift",outcome="{}"}}'
    assert [delta(outcome.format(o)) for o in ("ok", "error", "cancelled")] == [2, 1, 1]
    assert delta('nv_inference_request_failure{model="tokenswift",reason="BACKEND",version="1"}') == 1
    assert delta(f"tokenswift:time_to_first_token_seconds_count{model}") == 3
    assert delta(f"tokenswift:time_per_output_token_seconds_count{model}") == 3
    assert delta(f"tokenswift:e2e_request_latency_seconds_count{model}") == 4


MALFORMED_BODIES = [
    (b"hello", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"text_input": PROMPT, "max_tokens": "ten"}).encode(), "max_tokens must be an integer"),
    (json.dumps({"text_input": PROMPT, "max_tokens": 3.5}).encode(), "max_tokens must be an integer"),
    (json.dumps({"text_input": PROMPT, "max_tokens": 8, "seed": -1}).encode(), "seed must be"),
    (json.dumps({"text_input": PROMPT, "max_tokens": 8, "seed": 2**70}).encode(), "seed must be"),
    (json.dumps({"text_input": PROMPT, "max_tokens": 8, "ignore_eos": "yes"}).encode(), "ignore_eos"),
    (json.dumps({"text_input": PROMPT, "max_tokens": 8, "temprature": 0}).encode(), "temprature"),
    (json.dumps({"text_input": PROMPT, "max_tokens": 8, "temperature": 1e300}).encode(), "temperature"),
]


@pytest.mark.slow
def test_the_http_front_answers_malformed_bodies_with_400_and_relays_the_rest(server, front):
    for body, match in MALFORMED_BODIES:
        for path in ("generate", "generate_stream"):
            status, answer = _post(front.url, f"/v2/models/tokenswift/{path}", body)
            assert status == 400 and match in answer["error"], (body, status, answer)
    # an unknown field sent straight to Triton is refused by the model itself, also with 400
    status, answer = _post(server.http_url, "/v2/models/tokenswift/generate", MALFORMED_BODIES[7][0])
    assert status == 400 and "temprature" in answer["error"]
    # valid requests through the front: the same text as Triton's endpoint, whole and streamed
    direct = generate_endpoint(server.http_url, _params(41, max_tokens=16), stream=False)
    assert generate_endpoint(front.url, _params(41, max_tokens=16), stream=False).text == direct.text
    streamed = generate_endpoint(front.url, _params(41, max_tokens=16), stream=True)
    assert streamed.text == direct.text and streamed.chunks > 2
    with urllib.request.urlopen(f"http://{front.url}/v2/health/ready", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://{front.url}/v2/models/tokenswift/config", timeout=10) as response:
        assert json.loads(response.read())["name"] == "tokenswift"


@pytest.mark.slow
def test_disconnecting_mid_stream_through_the_front_cancels_the_request(server, front):
    before = _scrape(server)
    body = json.dumps(_params(42, max_tokens=3000, method="ar", stream=True)).encode()
    host, port = front.url.rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=60)
    connection.sendall(
        b"POST /v2/models/tokenswift/generate_stream HTTP/1.1\r\nHost: x\r\n"
        + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while received.count(b"data: ") < 3:
        piece = connection.recv(65536)
        assert piece, f"the stream ended before 3 events: {received[-600:]!r}"
        received += piece
    connection.close()
    cancelled = 'tokenswift:request_success_total{model="tokenswift",outcome="cancelled"}'
    for _ in range(200):
        if _scrape(server).get(cancelled, 0) > before.get(cancelled, 0):
            break
        threading.Event().wait(0.1)
    assert _scrape(server)[cancelled] == before.get(cancelled, 0) + 1
    assert grpc_generate(server.grpc_url, _params(43, max_tokens=8)).text  # and it keeps serving

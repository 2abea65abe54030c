"""`serve` supervises its tritonserver: a quick clean stop on SIGTERM with a stream in flight, a crash
reported with a non-zero exit, and nothing left behind in /tmp or /dev/shm either way."""

from __future__ import annotations

import http.client as http_client
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tokenswift_trt.serving.server import SHARED_MEMORY, _bundled

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
psutil = pytest.importorskip("psutil", reason="these tests find tritonserver's processes with psutil")

from test_triton import MODEL, _free_ports, _params  # noqa: E402

from tokenswift_trt.serving.client import grpc_generate  # noqa: E402

CLI = [sys.executable, "-m", "tokenswift_trt.cli"]


def _leftovers(pid: int) -> set[str]:
    """The staging folder and shared-memory regions of the serve process `pid` still on disk (named
    by its pid: other servers, such as another test process's, are not its leftovers)."""
    staging = {str(p) for p in Path(tempfile.gettempdir()).glob(f"tokenswift-serve-{pid}-*")}
    regions = {str(p) for p in SHARED_MEMORY.glob(f"tokenswift_{pid}_*")}
    return staging | regions


def _start_serve(
    tmp_path: Path, openai: int = 0, http: int | None = None
) -> tuple[subprocess.Popen, int, Path]:
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    http_free, grpc, metrics = _free_ports(3)
    http = http or http_free
    journals = tmp_path / "journals"
    serve = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--engine",
            str(MODEL),
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--metrics-port",
            str(metrics),
            "--openai-port",
            str(openai),
            "--journal-dir",
            str(journals),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = serve.stdout.readline()
    assert line.startswith("ready:"), line + serve.stderr.read()
    return serve, grpc, journals


def _stream_in_background(grpc: int, request_id: str) -> threading.Thread:
    def run() -> None:
        try:
            grpc_generate(
                f"127.0.0.1:{grpc}",
                _params(3, max_tokens=3000, stream=True, request_id=request_id),
                timeout_s=120,
            )
        except BaseException:  # the server goes away under it
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for_tokens(journal: Path, count: int) -> None:
    from tokenswift_trt.decode.journal import read_journal

    for _ in range(1200):
        if journal.is_file() and len(read_journal(journal).tokens) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{journal} never held {count} tokens")


@pytest.mark.slow
def test_sigterm_with_a_stream_in_flight_stops_quickly_and_leaves_nothing(tmp_path):
    from tokenswift_trt.decode.journal import read_journal

    serve, grpc, journals = _start_serve(tmp_path)
    processes = [psutil.Process(serve.pid), *psutil.Process(serve.pid).children(recursive=True)]
    try:
        _stream_in_background(grpc, "long-1")
        _wait_for_tokens(journals / "long-1.journal", 32)
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0, serve.stderr.read()
        assert time.monotonic() - started < 10
    finally:
        if serve.poll() is None:
            serve.kill()
    _, alive = psutil.wait_procs(processes, timeout=5)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    state = read_journal(journals / "long-1.journal")  # intact and resumable
    assert len(state.tokens) >= 32 and not state.finished
    assert not _leftovers(serve.pid)


@pytest.mark.slow
def test_sigterm_cuts_an_openai_stream_with_finish_reason_abort_and_a_shutdown_error(tmp_path):
    """A stream cut by the server's shutdown never looks like a finished answer."""
    openai = pytest.importorskip("openai", reason="the OpenAI front is tested with the openai client")
    port, http = _free_ports(2)
    serve, _, _ = _start_serve(tmp_path, openai=port, http=http)
    chunks: list = []
    events: list[bytes] = []

    def triton_stream() -> None:  # the same cut seen by a Triton generate_stream client of the HTTP port
        body = {"text_input": "Call me Ishmael", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        url = f"http://127.0.0.1:{http}/v2/models/tokenswift/generate_stream"
        request = urllib.request.Request(url, data=json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                for line in response:
                    if line.startswith(b"data: "):
                        events.append(line)
                        streaming.set()
        except (OSError, http_client.HTTPException) as error:
            events.append(f"failed: {error!r}".encode())

    streaming = threading.Event()
    triton = threading.Thread(target=triton_stream, daemon=True)
    triton.start()
    try:
        assert streaming.wait(120), events
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model="swift-tiny",
            prompt="Once upon a time",
            max_tokens=3000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.APIError, match="server shutting down") as caught:
            for chunk in stream:
                chunks.append(chunk.choices[0])
                if len(chunks) == 8:
                    serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
    assert caught.value.body is None or caught.value.body.get("code") == "server_shutdown"
    assert chunks[-1].finish_reason == "abort" and all(c.finish_reason is None for c in chunks[:-1])
    triton.join(30)
    assert len(events) > 1 and b"text_output" in events[0], events[:3]
    assert json.loads(events[-1][len(b"data: ") :])["error"].startswith("server shutting down: "), events[-1]


@pytest.mark.slow
def test_a_crashed_tritonserver_is_reported_and_cleaned_up(tmp_path):
    serve, grpc, journals = _start_serve(tmp_path)
    try:
        tritonserver = next(
            p for p in psutil.Process(serve.pid).children() if p.name().startswith("tritonserver")
        )
        group = [tritonserver, *tritonserver.children(recursive=True)]
        assert any("triton_python" in p.name() for p in group[1:])  # the Python-backend stub runs under it
        _stream_in_background(grpc, "crash-1")
        _wait_for_tokens(journals / "crash-1.journal", 16)
        tritonserver.kill()
        code = serve.wait(timeout=60)
        stderr = serve.stderr.read()
    finally:
        if serve.poll() is None:
            serve.kill()
    assert code == 2 and "tritonserver exited unexpectedly" in stderr and "Traceback" not in stderr
    _, alive = psutil.wait_procs(group, timeout=5)
    assert not alive, f"the stub outlived its server: {[p.pid for p in alive]}"
    assert not _leftovers(serve.pid)


@pytest.mark.slow
def test_a_killed_serve_takes_its_tritonserver_with_it(tmp_path):
    serve, grpc, journals = _start_serve(tmp_path)
    try:
        tritonserver = next(
            p for p in psutil.Process(serve.pid).children() if p.name().startswith("tritonserver")
        )
        assert list(SHARED_MEMORY.glob(f"tokenswift_{serve.pid}_*"))  # its stub's regions
        serve.kill()  # SIGKILL: serve itself cleans nothing up
        serve.wait(timeout=30)
        stubs = [p for p in tritonserver.children(recursive=True) if "triton_python" in p.name()]
        _, alive = psutil.wait_procs([tritonserver], timeout=10)
        assert not alive, "tritonserver outlived the serve that started it"
        psutil.wait_procs(stubs, timeout=30)  # an idle stub ends when its server is gone
        # what a killed serve could not remove, the next start does
        from tokenswift_trt.serving.server import remove_stale_leftovers

        staging = list(Path(tempfile.gettempdir()).glob(f"tokenswift-serve-{serve.pid}-*"))
        assert staging  # left by the killed serve
        remove_stale_leftovers()
        assert not list(SHARED_MEMORY.glob(f"tokenswift_{serve.pid}_*"))
        assert not any(path.exists() for path in staging)
    finally:
        if serve.poll() is None:
            serve.kill()

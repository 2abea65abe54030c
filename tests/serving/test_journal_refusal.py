"""The Triton handler never replaces an unfinished journal, resumes only with the model that wrote
it, and refuses out-of-range sampling values (Session.parse, without a server)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.journal import JournalWriter, journal_header, read_journal
from tokenswift_trt.serving.handler import RequestError, Session

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").is_file(), reason="models/swift-tiny is not in this checkout"
)


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Session:
    return Session(MODEL, journal_dir=tmp_path_factory.mktemp("journals"))


def _inputs(**values) -> dict[str, np.ndarray]:
    inputs = {"text_input": np.array([b"It is a truth"], dtype=np.object_), "max_tokens": np.array([8])}
    for name, value in values.items():
        inputs[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
    return inputs


def _journal(path: Path, finished: bool, model: dict | None = None) -> bytes:
    writer = JournalWriter(
        path, journal_header([1, 2], GenerationConfig(max_new_tokens=8, seed=3), model=model)
    )
    writer.add([5, 6, 7])
    writer.close(finished=finished)
    return path.read_bytes()


def test_a_new_request_with_the_id_of_an_unfinished_journal_is_refused(session):
    assert session.journal_dir is not None
    path = session.journal_dir / "job-1.journal"
    written = _journal(path, finished=False)
    with pytest.raises(
        RequestError, match=r"request_id job-1 holds an unfinished generation.*resume=true.*new request_id"
    ):
        session.parse(_inputs(request_id="job-1"))
    assert path.read_bytes() == written
    resumed = session.parse(
        {"request_id": np.array([b"job-1"], dtype=np.object_), "resume": np.array([True])}
    )
    assert resumed.done_ids == [5, 6, 7]
    resumed.release()

    _journal(path, finished=True)
    request = session.parse(_inputs(request_id="job-1"))  # a finished journal may be replaced
    assert request.journal == path and request.config.seed is not None
    assert session.parse(_inputs(request_id="job-2")).journal == session.journal_dir / "job-2.journal"


def test_resume_of_a_journal_from_another_model_is_refused(session):
    assert session.journal_dir is not None
    other = {
        "name": "/models/other",
        "vocab_size": 8192,
        "dtype": "float32",
        "fingerprint": "0123456789abcdef",
    }
    path = session.journal_dir / "job-3.journal"
    _journal(path, finished=False, model=other)
    with pytest.raises(
        RequestError, match=r"cannot resume job-3.journal: .*written by /models/other.*swift-tiny"
    ):
        session.parse(_inputs(request_id="job-3", resume=True))
    assert not read_journal(path).finished


def test_a_server_journal_records_the_model_and_resumes_only_with_it(session, tmp_path):
    request = session.parse(_inputs(request_id="recorded", seed=np.uint64(4)))
    session.run(request, on_text=lambda piece: None, cancelled=lambda: False)
    path = session.journal_dir / "recorded.journal"
    header = read_journal(path).header
    assert header["model"]["fingerprint"] == session.engine.fingerprint
    assert header["model"]["vocab_size"] == session.engine.config.vocab_size
    # a journal by the same model but another fingerprint (another checkpoint) is refused on resume
    other = {**header["model"], "fingerprint": "0" * len(header["model"]["fingerprint"]), "name": "other"}
    _journal(session.journal_dir / "foreign.journal", finished=False, model=other)
    with pytest.raises(RequestError, match="other"):
        session.parse(_inputs(request_id="foreign", resume=True))


@pytest.mark.parametrize("temperature", [float("inf"), 1e300, float("nan")])
def test_an_unusable_temperature_is_refused(session, temperature):
    with pytest.raises(RequestError, match=r"temperature must be in \[0, 100\]"):
        session.parse(_inputs(temperature=temperature))


def test_a_huge_tree_is_refused_naming_it(session):
    with pytest.raises(RequestError, match=r"tree '300,300' has 90,301 nodes"):
        session.parse(_inputs(tree="300,300"))


@pytest.mark.slow
def test_a_real_server_refuses_reusing_an_unfinished_request_id_and_bad_values_at_once(tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
    from tokenswift_trt.serving.client import ClientError, grpc_generate
    from tokenswift_trt.serving.server import ServerConfig, TritonServer, _bundled, free_port

    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    journals = tmp_path / "journals"
    journals.mkdir()
    written = _journal(journals / "job-1.journal", finished=False)
    other = {
        "name": "/models/other",
        "vocab_size": 8192,
        "dtype": "float32",
        "fingerprint": "0123456789abcdef",
    }
    _journal(journals / "job-2.journal", finished=False, model=other)
    config = ServerConfig(
        engine=MODEL,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        journal_dir=journals,
    )
    request = {"text_input": "It is a truth", "max_tokens": 4, "seed": 1}
    with TritonServer(config, log_path=tmp_path / "server.log") as server:
        with pytest.raises(
            ClientError, match=r"request_id job-1 holds an unfinished generation.*resume=true"
        ):
            grpc_generate(server.grpc_url, {**request, "request_id": "job-1"})
        assert (journals / "job-1.journal").read_bytes() == written
        with pytest.raises(ClientError, match=r"cannot resume job-2.journal: .*written by /models/other"):
            grpc_generate(server.grpc_url, {"request_id": "job-2", "resume": True})
        with pytest.raises(ClientError, match=r"temperature must be in \[0, 100\]"):
            grpc_generate(server.grpc_url, {**request, "temperature": float("inf")})
        started = time.perf_counter()
        with pytest.raises(ClientError, match=r"tree '300,300' has 90,301 nodes"):
            grpc_generate(server.grpc_url, {**request, "tree": "300,300"})
        assert time.perf_counter() - started < 5
        resumed = grpc_generate(server.grpc_url, {"request_id": "job-1", "resume": True})
        assert len(read_journal(journals / "job-1.journal").tokens) == 8 and resumed.text
        assert grpc_generate(server.grpc_url, {**request, "request_id": "job-1"}).text  # finished: replaced


def test_a_model_directory_s_recorded_settings_are_the_server_s_defaults(tmp_path):
    import shutil

    copy = tmp_path / "swift-tiny"
    shutil.copytree(MODEL, copy)
    recorded = {"preset": "x", "defaults": {"min_p": 0.1, "penalty": 1.2}}
    (copy / "tokenswift_defaults.json").write_text(json.dumps(recorded))
    served = Session(copy)
    assert served.defaults == {"min_p": 0.1, "penalty": 1.2}
    config = served.parse(_inputs()).config
    assert config.sampling.min_p == 0.1 and config.sampling.penalty == 1.2
    assert served.parse(_inputs(min_p=np.float32(0.0))).config.sampling.min_p == 0.0  # a request's value wins

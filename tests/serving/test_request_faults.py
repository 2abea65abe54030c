"""The handler names who failed: a resume that changes the journal's request is the client's mistake
(naming the field), a request id running elsewhere and a full queue are the server's (errors.py causes,
so that the fronts answer 503), and every request taken ends with its lock released."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenswift_trt.decode.journal import JournalLock, JournalWriter, journal_header
from tokenswift_trt.decode.request import config_from
from tokenswift_trt.serving.errors import BUSY, HELD, SHUTTING_DOWN, ServerFault, cause_of, fault_of
from tokenswift_trt.serving.handler import BatchRunner, RequestError, Session

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").is_file(), reason="models/swift-tiny is not in this checkout"
)
PROMPT = "It is a truth"


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Session:
    return Session(MODEL, journal_dir=tmp_path_factory.mktemp("journals"))


def _inputs(**values) -> dict[str, np.ndarray]:
    return {
        name: np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)
        for name, value in values.items()
    }


def _unfinished(session: Session, name: str) -> Path:
    """A journal of PROMPT (8 tokens wanted, 3 written) with the session's own defaults, temperature 0."""
    path = session.journal_dir / f"{name}.journal"
    config = config_from(session.defaults, {"max_new_tokens": 8, "temperature": 0.0, "seed": 3})
    writer = JournalWriter(path, journal_header(session.codec.encode(PROMPT), config))
    writer.add([5, 6, 7])
    writer.close(finished=False)
    return path


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"temperature": 0.7}, "temperature (the journal's is 0.0)"),
        ({"max_tokens": 9}, "max_tokens (the journal's is 8)"),
        ({"text_input": "Another prompt"}, "text_input (another prompt)"),
        ({"seed": np.uint64(4), "ignore_eos": True}, "seed (the journal's is 3), ignore_eos"),
    ],
)
def test_a_resume_that_changes_the_request_is_refused_naming_the_field(session, changes, named):
    _unfinished(session, "changed")
    with pytest.raises(RequestError, match=r"resume continues the journal's request, which this one changes"):
        session.parse(_inputs(request_id="changed", resume=True, **changes))
    try:
        session.parse(_inputs(request_id="changed", resume=True, **changes))
    except RequestError as error:
        assert named in str(error)


def test_a_resume_that_repeats_the_request_or_changes_only_speed_is_taken(session):
    _unfinished(session, "repeated")
    same = _inputs(request_id="repeated", resume=True, text_input=PROMPT, max_tokens=8, temperature=0.0)
    request = session.parse({**same, **_inputs(seed=np.uint64(3), tree="2,2", ngram_topk=2)})
    assert request.done_ids == [5, 6, 7] and str(request.config.tree) == "2,2" and request.config.seed == 3
    request.release()


def test_a_request_id_in_flight_is_refused_as_running_elsewhere_until_it_ends(session):
    first = session.parse(_inputs(request_id="busy-id", text_input=PROMPT, max_tokens=8))
    with pytest.raises(ServerFault, match=r"request running elsewhere: request_id busy-id .* this server"):
        session.parse(_inputs(request_id="busy-id", text_input=PROMPT, max_tokens=8))
    with pytest.raises(ServerFault) as caught:
        session.parse(_inputs(request_id="busy-id", resume=True))
    assert caught.value.cause is HELD
    text, _ = session.run(first, on_text=lambda piece: None, cancelled=lambda: False)  # releases the id
    assert text
    again = session.parse(_inputs(request_id="busy-id", text_input=PROMPT, max_tokens=8))
    again.release()


def test_a_request_refused_by_its_values_leaves_its_id_free(session):
    with pytest.raises(RequestError):
        session.parse(_inputs(request_id="bad-values", text_input=PROMPT, max_tokens=8, temperature=-1.0))
    JournalLock(session.journal_dir / "bad-values.journal", holder="test").release()


def test_a_full_queue_is_server_busy_and_a_closed_runner_is_shutting_down(session):
    runner = BatchRunner(session.engine, max_batch=1, memory_budget=None, max_queue=1)
    config = config_from(session.defaults, {"max_new_tokens": 4, "temperature": 0.0})
    ended = []
    prompt = session.codec.encode(PROMPT)
    try:
        with runner.condition:  # no step runs meanwhile: both wait in the queue
            runner.submit(prompt, config, lambda ids: None, lambda: False, ended.append)
            runner.submit(prompt, config, lambda ids: None, lambda: False, ended.append)
            with pytest.raises(ServerFault, match=r"server busy: 0 requests are generating and 2 wait"):
                runner.submit(prompt, config, lambda ids: None, lambda: False, ended.append)
    finally:
        runner.close()
    assert {request.failure.cause for request in ended} <= {SHUTTING_DOWN}
    with pytest.raises(ServerFault) as caught:
        runner.submit(prompt, config, lambda ids: None, lambda: False, ended.append)
    assert caught.value.cause is SHUTTING_DOWN


def test_causes_are_read_back_from_messages_and_memory_errors_are_named():
    assert cause_of(str(ServerFault(BUSY, "8 wait"))) is BUSY
    assert cause_of("temperature must be in [0, 100]") is None
    assert fault_of(MemoryError("cannot allocate")).cause.reason == "out_of_memory"
    assert str(fault_of(RuntimeError("a tensor-parallel rank stopped"))).startswith("generation failed: ")

"""The OpenAI-compatible front, called with the real `openai` client: request translation and chat
templates on their own, then against a real tritonserver serving swift-tiny."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tokenswift_trt.serving.openai_api import OpenAIFrontend
from tokenswift_trt.serving.openai_requests import (
    ApiError,
    ChatTemplate,
    ServedModel,
    translate_chat,
    translate_completion,
)
from tokenswift_trt.serving.openai_responses import Outcome, StopScanner, _usage
from tokenswift_trt.serving.openai_triton import _relayed

openai = pytest.importorskip(
    "openai", reason="the OpenAI API tests need the openai client (pip install openai)"
)

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
PROMPT = "It is a truth universally acknowledged, that a single man"
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Answer in the style of the novel."},
    {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
]
# MESSAGES through TEMPLATE, less the BOS the tokenizer adds itself
CHAT_PROMPT = f"system: Answer in the style of the novel.\nuser: {PROMPT}\nassistant:"
EXTRAS = {"min_p": 0.1, "ignore_eos": True}


def _chat_model_dir(directory: Path) -> Path:
    """A copy of swift-tiny whose tokenizer_config.json carries a chat template (the HF convention)."""
    target = directory / "swift-tiny"
    shutil.copytree(MODEL, target)
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
                "eos_token": "</s>",
                "chat_template": TEMPLATE,
            }
        )
    )
    return target


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return ServedModel.from_dir(MODEL)


def test_completion_maps_openai_fields_and_extras_onto_triton_inputs(model):
    request = translate_completion(
        {
            "model": "swift-tiny",
            "prompt": [PROMPT],
            "max_tokens": 40,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 2**64 - 1,
            "n": 1,
            "stop": None,
            "presence_penalty": 0,
            "user": "someone",
            "min_p": 0.1,
            "top_k": 20,
            "repetition_penalty": 1.1,
            "penalty_window": 64,
            "method": "ar",
            "tree": 3,
            "ngram_topk": 4,
            "eta": 0.5,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        model,
    )
    assert request.params == {
        "text_input": PROMPT,
        "max_tokens": 40,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 2**64 - 1,
        "min_p": 0.1,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "penalty_window": 64,
        "method": "ar",
        "tree": "3",
        "ngram_topk": 4,
        "eta": 0.5,
        "ignore_eos": True,
    }
    assert request.stream and request.include_usage
    assert request.prompt_tokens == len(model.codec.encode(PROMPT))
    # unset settings stay unset (the engine's defaults apply, as for Triton clients); OpenAI's 16
    default = translate_completion({"prompt": PROMPT}, model)
    assert default.params == {"text_input": PROMPT, "max_tokens": 16} and not default.stream


BAD_COMPLETIONS = [
    ({"prompt": PROMPT, "temprature": 0}, "unknown field 'temprature'", "temprature"),
    ({"prompt": PROMPT, "n": 2}, "n must be 1", "n"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens must be an integer, got 'ten'", "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 3.5}, "max_tokens must be an integer", "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens must be positive", "max_tokens"),
    ({"prompt": PROMPT, "temperature": float("inf")}, "temperature must be a finite number", "temperature"),
    ({"prompt": PROMPT, "temperature": float("nan")}, "temperature must be a finite number", "temperature"),
    ({"prompt": PROMPT, "seed": -1}, r"seed must be in \[0, 18446744073709551615\]", "seed"),
    ({"prompt": PROMPT, "seed": 2**70}, r"seed must be in", "seed"),
    ({"prompt": PROMPT, "ignore_eos": "yes"}, "ignore_eos must be true or false", "ignore_eos"),
    ({"prompt": PROMPT, "top_k": True}, "top_k must be an integer", "top_k"),
    ({"prompt": PROMPT, "stop": 7}, "stop must be a string or a list of strings", "stop"),
    ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "at most 4 sequences", "stop"),
    (
        {"prompt": PROMPT, "frequency_penalty": 0.5},
        "repetition_penalty and penalty_window",
        "frequency_penalty",
    ),
    (
        {"prompt": PROMPT, "stream_options": {"include_usage": True}},
        "only allowed with stream",
        "stream_options",
    ),
    ({"prompt": [1, 2, 3]}, "prompt must be one string", "prompt"),
    ({"max_tokens": 4}, "prompt is required", "prompt"),
]


@pytest.mark.parametrize("body,message,param", BAD_COMPLETIONS)
def test_bad_completion_fields_are_refused_naming_the_field(model, body, message, param):
    with pytest.raises(ApiError, match=message) as caught:
        translate_completion(body, model)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_stop_sequences_cut_the_text_across_pieces():
    scanner = StopScanner(("o w", "\n\n"))
    assert scanner.push("Hel") == "Hel"
    assert scanner.push("lo") == "l"  # "o" may begin "o w": held back
    assert scanner.push("\n") == "o"  # now "\n" may begin "\n\n"
    assert scanner.push("x o") == "\nx "
    assert scanner.push(" world") == "" and scanner.hit == "o w"
    plain = StopScanner(())
    assert plain.push("o w") == "o w" and plain.hit is None


def test_usage_comes_from_tritons_outputs_else_from_the_tokenizer(model):
    request = translate_completion({"prompt": PROMPT, "max_tokens": 8, "stop": "\n"}, model)
    final = {"prompt_tokens": 13, "completion_tokens": 5, "finish_reason": "stop", "total_draft_tokens": 4}
    usage, reason, figures = _usage(model, request, Outcome(text="abc", final=final))
    assert usage == {"prompt_tokens": 13, "completion_tokens": 5, "total_tokens": 18}
    assert reason == "stop" and figures == {"draft_tokens": 4}
    # a stop sequence cancelled the generation: no final response, the text up to the stop counted
    usage, reason, figures = _usage(model, request, Outcome(text=" for the most", stop="\n"))
    assert usage["completion_tokens"] == model.text_tokens(" for the most\n") and reason == "stop"
    assert usage["prompt_tokens"] == len(model.codec.encode(PROMPT)) and figures == {}


def test_another_model_name_is_404_model_not_found(model):
    with pytest.raises(ApiError, match="serves 'swift-tiny'") as caught:
        translate_completion({"model": "gpt-4o", "prompt": PROMPT}, model)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"


def test_chat_prompt_is_the_one_transformers_apply_chat_template_gives(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory = _chat_model_dir(tmp_path)
    model = ServedModel.from_dir(directory)
    request = translate_chat({"messages": MESSAGES, "max_completion_tokens": 12, **EXTRAS}, model)
    assert request.params == {"text_input": CHAT_PROMPT, "max_tokens": 12, **EXTRAS}

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    plain = [{"role": "system", "content": MESSAGES[0]["content"]}, {"role": "user", "content": PROMPT}]
    rendered = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s>" + CHAT_PROMPT
    ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    # the handler's tokenizer adds the BOS the template wrote: one BOS, as transformers has
    assert model.codec.encode(request.params["text_input"]) == list(ids)
    assert request.prompt_tokens == len(ids)
    # without max_tokens a chat may run to the model's length, as OpenAI's chat does
    open_ended = translate_chat({"messages": MESSAGES}, model)
    assert open_ended.params["max_tokens"] == model.max_length - len(ids)


def test_template_sources_and_template_errors(tmp_path):
    directory = _chat_model_dir(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "x"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_dir(directory).source == "x"
    (directory / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}"
        "{% endif %}{{ messages[0]['content'] | tojson }}"
    )
    model = ServedModel.from_dir(directory)
    assert model.chat_prompt([{"role": "user", "content": "é"}]) == '"é"'
    with pytest.raises(ApiError, match="chat template refused these messages: the first message must be"):
        translate_chat({"messages": [{"role": "assistant", "content": "hi"}]}, model)


BAD_CHATS = [
    ({}, "messages is required"),
    ({"messages": []}, "non-empty list"),
    ({"messages": ["hi"]}, r'messages\[0\] must be an object with a "role"'),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tool calls are not supported"),
    ({"messages": MESSAGES, "prompt": PROMPT}, "unknown field 'prompt'"),
    (
        {"messages": [{"role": "robot", "content": "hi"}]},
        r"messages\[0\].role must be one of system, .* 'robot'",
    ),
    ({"messages": [{"role": "user"}]}, r"messages\[0\].content is required"),
    ({"messages": [{"role": "user", "content": None}]}, r"messages\[0\].content is required"),
]


@pytest.mark.parametrize("body,message", BAD_CHATS)
def test_bad_chat_requests_are_refused(tmp_path, body, message):
    model = ServedModel.from_dir(_chat_model_dir(tmp_path))
    with pytest.raises(ApiError, match=message):
        translate_chat(body, model)


def test_a_lone_surrogate_is_a_client_error_naming_the_field():
    """JSON's "\\ud800" parses to a str no tokenizer can encode: 400 naming where it is, not a 500."""
    with OpenAIFrontend(f"127.0.0.1:{_closed_port()}", MODEL, port=0) as front:
        raw = b'{"messages": [{"role": "user", "content": "hi \\udc80"}], "max_tokens": 4}'
        status, error = _post_raw(front.url + "/chat/completions", raw)
        assert status == 400 and error["param"] == "messages", error
        assert (
            "messages[0].content is not valid Unicode (a lone surrogate at character 3)" in error["message"]
        )
        status, error = _post_raw(front.url + "/completions", b'{"prompt": "\\ud800", "max_tokens": 4}')
        assert status == 400 and error["param"] == "prompt"


def test_a_model_without_chat_template_points_to_completions(model):
    with pytest.raises(ApiError, match="no chat template .* use /v1/completions") as caught:
        translate_chat({"messages": MESSAGES}, model)
    assert caught.value.status == 400


def test_triton_errors_are_relayed_as_client_or_server_errors():
    client = _relayed(400, b'data: {"error":"top-p must be in (0, 1], got 1.5"}\n\n')
    assert (client.status, client.kind, client.message) == (
        400,
        "invalid_request_error",
        "top-p must be in (0, 1], got 1.5",
    )
    fault = _relayed(400, b'{"error":"generation failed: CUDA error"}')
    assert (fault.status, fault.kind, fault.code) == (500, "server_error", "generation_failed")
    busy = _relayed(400, b'{"error":"server busy: 8 requests are generating and 256 wait"}')
    assert (busy.status, busy.code, busy.retry_after_s) == (503, "server_busy", 5)
    held = _relayed(400, b'data: {"error":"request running elsewhere: request_id a is being generated"}\n\n')
    assert (held.status, held.code) == (503, "request_running_elsewhere")


def _post_raw(url: str, raw: bytes) -> tuple[int, dict]:
    """POST bytes the openai client would not send (it refuses inf, non-JSON): (status, error object)."""
    request = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_front_without_tritonserver_lists_its_model_and_answers_503():
    with OpenAIFrontend(f"127.0.0.1:{_closed_port()}", MODEL, port=0, served_model_name="tiny") as front:
        client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        assert client.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.APIStatusError, match="unreachable") as caught:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert caught.value.status_code == 503 and caught.value.body["type"] == "server_error"
        with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
            client.completions.create(model="swift-tiny", prompt=PROMPT, max_tokens=4)
        status, error = _post_raw(front.url + "/completions", b"not json")
        assert status == 400 and "the body is not JSON" in error["message"]
        status, error = _post_raw(front.url + "/embeddings", b"{}")
        assert status == 404 and "POST /v1/completions" in error["message"]


@pytest.mark.parametrize(
    ("draining", "torn", "said"),
    [
        (False, True, "generation failed: the inference server stopped answering"),
        (False, False, "generation failed: the inference server stopped answering"),
        (True, True, "server shutting down: the generation was stopped before it finished"),
    ],
)
def test_a_stream_the_server_cuts_ends_with_finish_reason_abort_and_an_error_event(draining, torn, said):
    """The generate_stream connection torn after one piece (tritonserver killed), or ended without the
    last response: the client gets the piece, a chunk with finish_reason "abort", then OpenAI's error
    event naming the cause (shutting down while `serve` drains), never a finished-looking answer."""
    import http.client

    closed = []
    proceed = threading.Event()

    class CutStream:
        def stream(self, params):
            def events():
                yield {"text_output": " Once"}
                proceed.wait(30)
                if torn:
                    raise http.client.IncompleteRead(b"")

            return events(), lambda: closed.append(True)

    with OpenAIFrontend(f"127.0.0.1:{_closed_port()}", MODEL, port=0) as front:
        front.api.triton = CutStream()
        client = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0)
        stream = client.completions.create(model="swift-tiny", prompt=PROMPT, max_tokens=8, stream=True)
        front.api.draining = draining  # as `serve` does on SIGTERM, with this stream in flight
        proceed.set()
        chunks = []
        with pytest.raises(openai.APIError, match=said):
            for chunk in stream:
                chunks.append(chunk.choices[0])
    assert [c.text for c in chunks] == [" Once", ""] and closed
    assert [c.finish_reason for c in chunks] == [None, "abort"]


def test_a_draining_front_refuses_new_requests_with_503_and_retry_after():
    with OpenAIFrontend(f"127.0.0.1:{_closed_port()}", MODEL, port=0) as front:
        front.drain()
        request = urllib.request.Request(
            front.url + "/completions",
            data=json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 503 and caught.value.headers["Retry-After"] == "10"
        assert json.loads(caught.value.read())["error"]["code"] == "server_shutdown"


# --- against a real tritonserver --------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
    from test_triton import _free_ports

    from tokenswift_trt.serving.server import ServerConfig, TritonServer, _bundled

    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    directory = _chat_model_dir(tmp_path_factory.mktemp("openai"))
    http, grpc, metrics = _free_ports(3)
    config = ServerConfig(engine=directory, http_port=http, grpc_port=grpc, metrics_port=metrics)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    with (
        TritonServer(config, log_path=log) as server,
        OpenAIFrontend(server.http_url, directory, port=0) as front,
    ):
        yield server, front, openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0)


def _triton_text(server, prompt: str, max_tokens: int, seed: int) -> str:
    from tokenswift_trt.serving.client import generate_endpoint

    params = {"text_input": prompt, "max_tokens": max_tokens, "seed": seed, **EXTRAS}
    return generate_endpoint(server.http_url, params, stream=False).text


def _check_usage(usage, prompt_tokens: int, max_tokens: int) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == max_tokens
    assert usage.total_tokens == prompt_tokens + max_tokens


@pytest.mark.slow
def test_completions_equal_the_generate_endpoint_streaming_and_not(served):
    server, front, client = served
    expected = _triton_text(server, PROMPT, 40, seed=7)
    prompt_tokens = len(front.model.codec.encode(PROMPT))
    assert [m.id for m in client.models.list()] == ["swift-tiny"]

    whole = client.completions.create(
        model="swift-tiny", prompt=PROMPT, max_tokens=40, seed=7, extra_body=EXTRAS
    )
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    _check_usage(whole.usage, prompt_tokens, 40)
    assert whole.tokenswift["tokens_per_second"] > 0

    stream = client.completions.create(
        model="swift-tiny",
        prompt=PROMPT,
        max_tokens=40,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRAS,
    )
    chunks = list(stream)
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(texts) == expected and len([t for t in texts if t]) > 2
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert chunks[-1].choices == [] and all(chunk.usage is None for chunk in chunks[:-1])
    _check_usage(chunks[-1].usage, prompt_tokens, 40)


@pytest.mark.slow
def test_chat_completions_equal_the_generate_endpoint_on_the_templated_prompt(served):
    server, front, client = served
    expected = _triton_text(server, CHAT_PROMPT, 24, seed=3)
    prompt_tokens = len(front.model.codec.encode(CHAT_PROMPT))
    whole = client.chat.completions.create(
        model="swift-tiny", messages=MESSAGES, max_completion_tokens=24, seed=3, extra_body=EXTRAS
    )
    message = whole.choices[0].message
    assert (message.role, message.content) == ("assistant", expected)
    assert whole.choices[0].finish_reason == "length" and whole.object == "chat.completion"
    _check_usage(whole.usage, prompt_tokens, 24)

    chunks = list(
        client.chat.completions.create(
            model="swift-tiny", messages=MESSAGES, max_tokens=24, seed=3, stream=True, extra_body=EXTRAS
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    assert {chunk.object for chunk in chunks} == {"chat.completion.chunk"}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_text_before_it(served, stream):
    server, front, client = served
    expected = _triton_text(server, PROMPT, 40, seed=7)
    stop = expected[15:19]
    cut = expected[: expected.index(stop)]
    answer = client.completions.create(
        model="swift-tiny",
        prompt=PROMPT,
        max_tokens=40,
        seed=7,
        stop=[stop],
        stream=stream,
        extra_body=EXTRAS,
    )
    if stream:
        chunks = list(answer)
        text = "".join(chunk.choices[0].text for chunk in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = answer.choices[0].text, answer.choices[0].finish_reason
        assert answer.usage.completion_tokens == front.model.text_tokens(cut + stop) < 40
    assert (text, reason) == (cut, "stop")


@pytest.mark.slow
def test_acceptance_figures_of_a_drafting_request(served):
    server, _, client = served
    answer = client.completions.create(
        model="swift-tiny", prompt=PROMPT, max_tokens=40, seed=7, extra_body={**EXTRAS, "tree": "2,1"}
    )
    # every tree is lossless: the same text as the default plan
    assert answer.choices[0].text == _triton_text(server, PROMPT, 40, seed=7)
    figures = answer.tokenswift
    assert figures["draft_tokens"] > 0 and 0 <= figures["accepted_draft_tokens"] <= figures["draft_tokens"]
    assert figures["acceptance_rate"] == pytest.approx(
        figures["accepted_draft_tokens"] / figures["draft_tokens"]
    )
    adapted = client.completions.create(
        model="swift-tiny",
        prompt=PROMPT,
        max_tokens=40,
        seed=7,
        extra_body={**EXTRAS, "tree": "2,1", "adapt_drafts": True},
    )  # its own copy of the draft layers, adapted as it goes: the same text
    assert adapted.choices[0].text == answer.choices[0].text
    assert adapted.tokenswift["draft_updates"] > 0 and figures["draft_updates"] == 0


BAD_OVER_THE_WIRE = [
    ({"max_tokens": 8, "extra_body": {"temprature": 0}}, "unknown field 'temprature'"),
    ({"max_tokens": 8, "n": 2}, "n must be 1"),
    ({"max_tokens": "ten"}, "max_tokens must be an integer, got 'ten'"),
    ({"max_tokens": 8, "temperature": -1.0}, r"temperature must be .* got -1.0"),  # the handler's words
    ({"max_tokens": 8, "top_p": 1.5}, "top-p must be in"),
    ({"max_tokens": 8, "extra_body": {"method": "beam"}}, "method"),
    ({"max_tokens": 40000}, "maximum length"),
]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_raises_bad_request_with_the_reason(served, stream):
    server, _, client = served
    for arguments, message in BAD_OVER_THE_WIRE:
        with pytest.raises(openai.BadRequestError, match=message) as caught:
            client.completions.create(model="swift-tiny", prompt=PROMPT, stream=stream, **arguments)
        assert caught.value.body["type"] == "invalid_request_error", arguments
    # the openai client refuses to send inf itself; other clients can (JSON's Infinity)
    infinite = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": float("inf"), "stream": stream})
    status, error = _post_raw(str(client.base_url) + "completions", infinite.encode())
    assert status == 400 and error["message"] == "temperature must be a finite number, got inf"
    with pytest.raises(openai.BadRequestError, match="messages is required"):
        client.post("/chat/completions", cast_to=openai.types.Completion, body={"max_tokens": 8})
    assert client.completions.create(model="swift-tiny", prompt=PROMPT, max_tokens=4).choices[0].text


@pytest.mark.slow
def test_a_client_leaving_mid_stream_cancels_the_generation(served):
    server, _, client = served
    stream = client.completions.create(
        model="swift-tiny", prompt=PROMPT, max_tokens=3000, seed=5, stream=True
    )
    received = [chunk for _, chunk in zip(range(3), stream)]
    stream.close()
    assert len(received) == 3
    cancelled = 0.0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and cancelled < 1:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            lines = response.read().decode().splitlines()
        cancelled = sum(
            float(line.rsplit(" ", 1)[1]) for line in lines if re.search(r'outcome="cancelled"', line)
        )
        time.sleep(0.5)
    assert cancelled >= 1
    assert client.completions.create(model="swift-tiny", prompt=PROMPT, max_tokens=4).choices[0].text

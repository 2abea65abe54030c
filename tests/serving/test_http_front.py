"""The published HTTP port's checks of generate bodies, against the model's declared inputs."""

from __future__ import annotations

import json

import pytest

from tokenswift_trt.serving.http_front import BadRequest, check_generate_body, model_inputs
from tokenswift_trt.serving.server import MODEL_REPO

INPUTS = model_inputs(MODEL_REPO / "tokenswift" / "config.pbtxt")
GOOD = {"text_input": "Once upon a time", "max_tokens": 8}


def test_the_inputs_are_read_from_the_model_config():
    assert INPUTS["max_tokens"] == "TYPE_INT32" and INPUTS["seed"] == "TYPE_UINT64"
    assert INPUTS["ignore_eos"] == "TYPE_BOOL" and INPUTS["text_input"] == "TYPE_STRING"
    assert "text_output" not in INPUTS  # outputs are not inputs


@pytest.mark.parametrize(
    "raw,match",
    [
        (b"hello", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (json.dumps({**GOOD, "temprature": 0}).encode(), "unknown request field.*temprature"),
        (json.dumps({**GOOD, "max_tokens": "ten"}).encode(), 'max_tokens must be an integer, got "ten"'),
        (json.dumps({**GOOD, "max_tokens": 3.5}).encode(), "max_tokens must be an integer"),
        (json.dumps({**GOOD, "max_tokens": True}).encode(), "max_tokens must be an integer"),
        (json.dumps({**GOOD, "seed": -1}).encode(), r"seed must be an integer in \[0, "),
        (json.dumps({**GOOD, "seed": 2**70}).encode(), "seed must be an integer"),
        (json.dumps({**GOOD, "ignore_eos": "yes"}).encode(), 'ignore_eos must be true or false, got "yes"'),
        (json.dumps({**GOOD, "temperature": "hot"}).encode(), "temperature must be a number"),
        (json.dumps({**GOOD, "text_input": 5}).encode(), "text_input must be a string"),
        (json.dumps({**GOOD, "max_tokens": [1, 2]}).encode(), "exactly one value"),
        (b'{"text_input": "ab\\ud800", "max_tokens": 4}', "text_input is not valid Unicode .* character 2"),
    ],
)
def test_malformed_generate_bodies_are_named(raw, match):
    with pytest.raises(BadRequest, match=match):
        check_generate_body(raw, INPUTS)


@pytest.mark.parametrize(
    "body",
    [GOOD, {**GOOD, "seed": 2**64 - 1, "ignore_eos": True, "temperature": 1, "max_tokens": [8]}],
)
def test_well_formed_bodies_pass(body):
    check_generate_body(json.dumps(body).encode(), INPUTS)

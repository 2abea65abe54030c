"""`demo`'s editing request: its own row, with AR's tokens; the request goes through the model's chat
template where the model has one, and `--no-edit` skips it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenswift_trt.cli import main
from tokenswift_trt.cli.demo_edit import EDIT_REQUEST, edit_prompt

ROOT = Path(__file__).resolve().parents[2]
DEMO = ["demo", "--model", "swift-tiny", "--max-new-tokens", "32", "--users", "0", "--seed", "1"]


def test_demo_prints_the_editing_row_with_ars_tokens():
    result = CliRunner().invoke(main, DEMO)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.startswith("editing request (")]
    assert len(header) == 1 and "no chat template: plain text" in header[0]  # swift-tiny has none
    row = [line for line in lines if line.startswith("editing: speedup")]
    assert len(row) == 1 and row[0].endswith("same tokens as AR: True"), result.stdout
    assert any(line.startswith("why prose gains little here") for line in lines)


def test_no_edit_skips_the_editing_request_and_out_writes_the_rows(tmp_path):
    result = CliRunner().invoke(main, [*DEMO, "--no-edit", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    assert "editing" not in result.stdout and "speedup" in result.stdout
    document = json.loads((tmp_path / "demo" / "run.json").read_text())
    (row,) = document["rows"]
    assert row["job"] == "prose" and row["ar_tokens"] == row["tokenswift_tokens"] == 32
    assert row["same_tokens_as_ar"] and f"speedup {row['speedup']:.2f}x" in result.stdout
    command = document["meta"]["command"].split()  # the options given, in the command's order
    assert command[:2] == ["tokenswift-trt", "demo"]
    assert sorted(command[2:]) == sorted([*DEMO[1:], "--no-edit", "--out", str(tmp_path / "demo")])
    assert document["meta"]["date"] and document["meta"]["cpu"]


@pytest.mark.skipif(
    not (ROOT / "models/smollm2-135m/tokenizer_config.json").is_file(),
    reason="SmolLM2-135M-Instruct not downloaded (make models)",
)
def test_the_request_is_a_chat_turn_of_the_instruct_model():
    prompt, chat = edit_prompt(ROOT / "models/smollm2-135m")
    assert chat and prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{EDIT_REQUEST}<|im_end|>" in prompt

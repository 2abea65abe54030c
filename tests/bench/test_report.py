"""The JSON rows a command writes beside what it prints (`demo --out`): the machine, date, torch and
command that docs/bench artefacts record, and the rows as given."""

from __future__ import annotations

import json

import torch

from tokenswift_trt.bench.report import write_run_json


def test_run_json_holds_the_rows_with_the_machine_date_and_command(tmp_path):
    rows = [{"job": "prose", "speedup": 0.99, "same_tokens_as_ar": True}, {"job": "editing", "speedup": 1.7}]
    path = write_run_json(tmp_path / "demo", "tokenswift-trt demo --model swift-tiny", rows)
    assert path == tmp_path / "demo" / "run.json"
    document = json.loads(path.read_text())
    assert document["rows"] == rows
    meta = document["meta"]
    assert meta["command"] == "tokenswift-trt demo --model swift-tiny"
    assert meta["torch"] == torch.__version__ and meta["cpus"] >= 1 and meta["cpu"]
    assert len(meta["date"]) == 10 and meta["date"][4] == "-"  # ISO date

"""`train-data`: continuations the model samples itself after prompts cut from a dataset, each the
model's own `generate` output for that prompt and seed; a rerun continues the file, and `train-heads`
trains on the tokens as written."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import tokenswift_trt as ts
from tokenswift_trt.cli import main
from tokenswift_trt.cli.train_data import PAPER_SAMPLING
from tokenswift_trt.training.data import read_records

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
TEXT = "The mill stood by the river, and every morning the miller's daughter walked to the bridge. " * 6


def test_train_data_samples_the_models_own_continuations_and_train_heads_reads_them(tmp_path):
    prompts = tmp_path / "prompts.parquet"
    import datasets

    datasets.Dataset.from_dict({"body": [TEXT, TEXT.upper()]}).to_parquet(str(prompts))
    out = tmp_path / "generated.jsonl"
    args = ["train-data", "--model-dir", str(MODEL), "--prompts", str(prompts), "--field", "body"]
    args += ["--output", str(out), "--sequences", "3", "--prompt-tokens", "12", "--new-tokens", "24"]
    args += ["--seed", "5", "--max-batch", "2"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == ["0", "1", "2"]

    model = ts.load(model_dir=MODEL)
    prompt_ids = model.codec.encode(TEXT) + model.codec.encode(TEXT.upper())
    for line in lines:
        assert line["status"] == "finished" and 0 < len(line["token_ids"]) <= 24
    # each continuation is the model's own sample for its prompt window and seed, under the paper's sampling
    windows = {line["id"]: line for line in lines}
    import torch

    from tokenswift_trt.training.data import prompt_windows

    for index, window in enumerate(prompt_windows(torch.tensor(prompt_ids), 3, 12, 5)):
        expected = ts.generate(model, window, 24, seed=5 + index, **PAPER_SAMPLING)
        assert windows[str(index)]["token_ids"] == expected.token_ids

    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "3 of 3 requests already" in again.stderr
    assert len(out.read_text().splitlines()) == 3

    records = read_records([out])
    assert [list(r.token_ids or ()) for r in records] == [line["token_ids"] for line in lines]
    heads = tmp_path / "heads"
    train = CliRunner().invoke(
        main,
        ["train-heads", "--model-dir", str(MODEL), "--data", str(out), "--out", str(heads), "--steps", "1"]
        + ["--seq-len", "16", "--grad-accum", "1", "--warmup-steps", "1", "--draft-vocab", "0"],
    )
    assert train.exit_code == 0, train.output
    report = json.loads((heads / "train_heads.json").read_text())
    assert report["train_tokens"] + report["eval_tokens"] == sum(len(line["token_ids"]) + 1 for line in lines)


def test_train_data_refuses_a_missing_column_in_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"body": "x"}\n')
    args = [
        "train-data",
        "--model-dir",
        str(MODEL),
        "--prompts",
        str(prompts),
        "--output",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "no 'text' column (it has body)" in result.stderr and "--field" in result.stderr

"""The `tokenswift-trt` command: generation output, streaming, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.cli import main
from tokenswift_trt.cli.common import unequal_tokens_note


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("random-tiny"), seed=1)


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_generate_json_reports_tokens_and_rates(model_dir):
    args = ["--model-dir", str(model_dir), "--prompt", "Hello there", "--max-new-tokens", "64"]
    args += ["--temperature", "0", "--ignore-eos", "--json"]
    result = _run("generate", *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) >= {
        "text",
        "token_ids",
        "new_tokens",
        "acceptance_rate",
        "ngram_acceptance_rate",
        "tokens_per_s",
        "elapsed_s",
        "method",
    }
    assert report["new_tokens"] == len(report["token_ids"]) == 64
    assert report["method"] == "tokenswift" and 0 <= report["acceptance_rate"] <= 1

    ar = _run(
        "generate",
        "--model-dir",
        str(model_dir),
        "--prompt",
        "Hello there",
        "--max-new-tokens",
        "64",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--method",
        "ar",
    )
    assert json.loads(ar.stdout.strip().splitlines()[-1])["token_ids"] == report["token_ids"]

    device_loop = _run("generate", *args, "--tree", "3,3,3", "--device-loop")
    assert json.loads(device_loop.stdout.strip().splitlines()[-1])["token_ids"] == report["token_ids"]


def test_seeded_sampling_is_reproducible_and_streams_the_same_text(model_dir):
    args = [
        "generate",
        "--model-dir",
        str(model_dir),
        "--prompt",
        "Once",
        "--max-new-tokens",
        "48",
        "--seed",
        "5",
        "--min-p",
        "0.1",
        "--penalty",
        "1.2",
        "--penalty-window",
        "16",
        "--ignore-eos",
    ]
    first = json.loads(_run(*args, "--json").stdout.strip().splitlines()[-1])
    second = json.loads(_run(*args, "--json").stdout.strip().splitlines()[-1])
    assert first["token_ids"] == second["token_ids"] and first["seed"] == 5
    streamed = _run(*args, "--stream")
    assert streamed.exit_code == 0
    assert streamed.stdout.rstrip("\n") == first["text"]


@pytest.mark.parametrize(
    "args,match",
    [
        (["--model-dir", "/nonexistent/model", "--prompt", "x", "--max-new-tokens", "5"], "does not exist"),
        (["--prompt", "", "--max-new-tokens", "5"], "prompt is empty"),
        (["--prompt", "x", "--max-new-tokens", "0"], "max new tokens"),
        (["--prompt", "x", "--max-new-tokens", "-3"], "max new tokens"),
        (["--prompt", "x", "--max-new-tokens", "5", "--temperature", "-1"], "temperature"),
        (["--prompt", "x", "--max-new-tokens", "5", "--top-p", "0"], "top-p"),
        (["--prompt", "x", "--max-new-tokens", "5", "--top-p", "1.2"], "top-p"),
        (["--prompt", "x", "--max-new-tokens", "5", "--min-p", "1"], "min-p"),
        (["--prompt", "x", "--max-new-tokens", "5", "--penalty", "0.5"], "penalty"),
        (["--prompt", "x", "--max-new-tokens", "5", "--tree", "1,,3"], "tree"),
        (["--prompt", "x", "--max-new-tokens", "5", "--tree", "1,3,3,3,3"], "draft layers"),
        (
            ["--prompt", "x", "--max-new-tokens", "5", "--kv-budget", "64", "--kv-recent", "64"],
            "recent region",
        ),
        (
            ["--prompt", "x", "--max-new-tokens", "5", "--device-loop", "--draft-source", "partial"],
            "verify pass",
        ),
        (["--max-new-tokens", "5"], "exactly one of --prompt"),
        (["--prompt", "x", "--max-new-tokens", "five"], "five"),
        (["--prompt-file", "/nonexistent/prompt.txt", "--max-new-tokens", "5"], "cannot read prompt file"),
    ],
)
def test_bad_input_gives_one_line_error_and_exit_code_2(model_dir, args, match):
    if "--model-dir" not in args:
        args = ["--model-dir", str(model_dir), *args]
    result = _run("generate", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenswift-trt: error:"), result.stderr
    assert match in lines[0]
    assert "Traceback" not in result.output


def test_prompt_longer_than_the_engine_is_refused(model_dir):
    result = _run(
        "generate",
        "--model-dir",
        str(model_dir),
        "--prompt",
        "x" * 100,
        "--max-new-tokens",
        "5",
        "--max-length",
        "50",
    )
    assert result.exit_code == 2 and "maximum length" in result.stderr
    capped = _run(
        "generate",
        "--model-dir",
        str(model_dir),
        "--prompt",
        "x" * 10,
        "--max-new-tokens",
        "100",
        "--max-length",
        "50",
        "--ignore-eos",
        "--temperature",
        "0",
    )
    assert (
        capped.exit_code == 0 and "room for 39 new tokens, not 100" in capped.stderr
    )  # said up front (BOS + 10)


def test_installed_console_script_prints_no_traceback(tmp_path):
    script = [sys.executable, "-m", "tokenswift_trt.cli"]
    result = subprocess.run(
        [
            *script,
            "generate",
            "--model-dir",
            str(tmp_path / "absent"),
            "--prompt",
            "x",
            "--max-new-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr


def test_demo_compares_ar_and_tokenswift(model_dir):
    result = _run(
        "demo", "--model-dir", str(model_dir), "--max-new-tokens", "64", "--temperature", "0", "--ignore-eos",
        "--tree", "1,1",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "RANDOM weights" in result.stderr
    assert (
        "same tokens as AR: True" in result.stdout
        and "speedup" in result.stdout
        and "tokens/forward" in result.stdout
    )
    by_depth = re.search(r"α by depth: (.*?)   \(", result.stdout)
    assert by_depth, result.stdout
    alphas = [float(part.split()[1]) for part in re.findall(r"\d+: [0-9.]+ \(\d+\)", by_depth.group(1))]
    assert alphas and all(0 <= alpha <= 1 for alpha in alphas)


def test_random_model_refuses_to_overwrite(model_dir):
    result = _run("random-model", "--out", str(model_dir))
    assert result.exit_code == 2 and "--force" in result.stderr


def test_resume_keeps_the_journals_settings_and_leaves_a_finished_journal_alone(model_dir, tmp_path):
    journal = tmp_path / "run.journal"
    args = [
        "generate",
        "--model-dir",
        str(model_dir),
        "--prompt",
        "Once",
        "--max-new-tokens",
        "40",
        "--seed",
        "5",
        "--min-p",
        "0.1",
        "--ignore-eos",
        "--journal",
        str(journal),
        "--json",
    ]
    first = json.loads(_run(*args).stdout.strip().splitlines()[-1])
    for extra, named in (
        (["--seed", "9"], "--seed"),
        (["--max-new-tokens", "80"], "--max-new-tokens"),
        (["--min-p", "0.2", "--penalty", "1.1"], "--min-p, --penalty"),
    ):
        refused = _run("generate", "--resume", str(journal), *extra)
        assert refused.exit_code == 2 and f"drop {named}" in refused.stderr, refused.output
    written = journal.read_bytes()
    again = _run(
        "generate", "--resume", str(journal), "--tree", "1,1", "--json"
    )  # speed-only options are taken
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout.strip().splitlines()[-1])["token_ids"] == first["token_ids"]
    assert journal.read_bytes() == written  # finished: nothing appended


def test_a_preset_name_runs_its_local_model_with_the_presets_settings():
    from tokenswift_trt.builder.presets import PRESETS, local_model_dir

    directory, _ = local_model_dir(PRESETS["swift-tiny"])
    common = ["--prompt", "It is a truth", "--max-new-tokens", "24", "--seed", "1", "--ignore-eos", "--json"]
    by_name = _run("generate", "--model", "swift-tiny", *common)
    assert by_name.exit_code == 0, by_name.output
    settings = [
        f"--{name.replace('_', '-')}={value}" for name, value in PRESETS["swift-tiny"].defaults.items()
    ]
    by_dir = _run("generate", "--model-dir", str(directory), *settings, *common)
    plain = _run("generate", "--model-dir", str(directory), *common)  # without the preset's penalty
    ids = [json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] for r in (by_name, by_dir, plain)]
    assert ids[0] == ids[1] != ids[2]
    unknown = _run("generate", "--model", "nope", *common)
    assert unknown.exit_code == 2 and "unknown preset 'nope'" in unknown.stderr
    both = _run("generate", "--model", "swift-tiny", "--model-dir", str(directory), *common)
    assert both.exit_code == 2 and "exactly one of --model PRESET" in both.stderr


def test_unequal_tokens_are_explained_on_low_precision_gpus_and_flagged_elsewhere():
    gpu = unequal_tokens_note("cuda", "torch.bfloat16")
    assert gpu.startswith("note:") and "bfloat16 on a GPU" in gpu and "docs/gpu.md" in gpu
    assert "float16 on a GPU" in unequal_tokens_note("cuda:1", "torch.float16")
    for device, dtype in (("cpu", "torch.float32"), ("cpu", "torch.bfloat16"), ("cuda", "torch.float32")):
        note = unequal_tokens_note(device, dtype)
        assert note.startswith("warning:") and "should be equal" in note and dtype[6:] in note

"""The CLI's fault matrix: each bad input or damaged file gets one line naming the problem and the fix
(exit code 2, no traceback), and no unfinished journal is ever overwritten."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.cli import main
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.journal import JournalWriter, journal_header, read_journal
from tokenswift_trt.model.config import load_config

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
PROMPT = ["--prompt", "It is a truth universally acknowledged"]

pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").is_file(), reason="models/swift-tiny is not in this checkout"
)


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _generate(*args: str):
    return _run("generate", "--model-dir", str(MODEL), *PROMPT, *args)


def _one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenswift-trt: error:"), result.stderr
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> bytes:
    """A journal of a 40-token generation interrupted after 16 tokens (kill -9: no finished record)."""
    path = tmp_path_factory.mktemp("journal") / "run.journal"
    result = _generate(
        "--max-new-tokens", "40", "--seed", "1", "--ignore-eos", "--journal", str(path),
        "--journal-every", "8", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:3]))
    state = read_journal(path)
    assert len(state.tokens) == 16 and not state.finished
    return path.read_bytes()


def test_an_unfinished_journal_is_refused_not_overwritten_and_a_finished_one_is_replaced(
    tmp_path, interrupted
):
    journal = tmp_path / "run.journal"
    written = interrupted
    journal.write_bytes(written)
    refused = _generate("--max-new-tokens", "5", "--journal", str(journal))
    line = _one_line_error(refused, f"--resume {journal}", "unfinished", "16 of 40", "delete it")
    assert "choose another --journal path" in line
    assert journal.read_bytes() == written and not list(tmp_path.glob("*.tmp"))

    resumed = _run("generate", "--resume", str(journal), "--json")
    assert resumed.exit_code == 0, resumed.output
    assert read_journal(journal).finished
    replaced = _generate("--max-new-tokens", "5", "--seed", "2", "--journal", str(journal), "--json")
    assert replaced.exit_code == 0, replaced.output
    state = read_journal(journal)
    assert state.finished and state.header["settings"]["max_new_tokens"] == 5

    other = tmp_path / "notes.txt"
    other.write_text("my notes\n")
    _one_line_error(_generate("--max-new-tokens", "5", "--journal", str(other)), "not a tokenswift journal")
    assert other.read_text() == "my notes\n"
    assert "never replaced" in " ".join(_run("generate", "--help").output.split())


@pytest.mark.parametrize("damage", ["half", "five_bytes"])
def test_a_truncated_or_corrupt_checkpoint_is_one_line_naming_the_file(tmp_path, damage):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json", "heads.safetensors"):
        (model_dir / name).write_bytes((MODEL / name).read_bytes())
    weights = (MODEL / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(
        weights[: len(weights) // 2] if damage == "half" else weights[:5]
    )
    result = _run("generate", "--model-dir", str(model_dir), *PROMPT, "--max-new-tokens", "3")
    _one_line_error(result, str(model_dir / "model.safetensors"), "truncated or corrupt", "download")


def test_a_garbage_heads_file_is_one_line_naming_the_file(tmp_path):
    heads = tmp_path / "heads.safetensors"
    heads.write_bytes(os.urandom(4096))
    result = _generate("--max-new-tokens", "3", "--heads", str(heads))
    _one_line_error(result, str(heads), "train-heads")
    heads.write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00{"a":1}')  # a header that parses, then nonsense
    _one_line_error(_generate("--max-new-tokens", "3", "--heads", str(heads)), str(heads))


def test_a_journal_that_is_a_directory_or_cannot_be_written_is_refused_before_generating(tmp_path):
    directory = tmp_path / "journals"
    directory.mkdir()
    _one_line_error(
        _generate("--max-new-tokens", "3", "--journal", str(directory)), "is a directory", "name a file"
    )
    assert not list(tmp_path.rglob("*.tmp")) and not any(directory.iterdir())
    unwritable = Path("/proc/tokenswift-no-such-dir/run.journal")
    _one_line_error(
        _generate("--max-new-tokens", "3", "--journal", str(unwritable)), "cannot write the journal"
    )
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    _one_line_error(
        _generate("--max-new-tokens", "3", "--journal", str(not_a_dir / "run.journal")), "cannot write"
    )
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "lots"])
def test_memory_budget_must_be_a_positive_finite_number(value):
    started = time.perf_counter()
    line = _one_line_error(_generate("--max-new-tokens", "3", "--memory-budget", value), "--memory-budget")
    assert "positive number of GiB" in line and time.perf_counter() - started < 2
    serve = _run("serve", "--engine", "/nonexistent", "--memory-budget", value)
    _one_line_error(serve, "--memory-budget", "positive number of GiB")


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "-0.5", "101"])
def test_temperature_outside_its_range_is_refused_naming_the_range(value):
    _one_line_error(_generate("--max-new-tokens", "3", "--temperature", value), "temperature", "[0, 100]")


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_penalty_outside_its_range_is_refused(value):
    _one_line_error(_generate("--max-new-tokens", "3", "--penalty", value), "penalty must be in [1,")


@pytest.mark.parametrize("value", ["0", "-4", "1"])
def test_max_length_below_two_is_refused_not_ignored(value):
    _one_line_error(
        _generate("--max-new-tokens", "3", "--max-length", value), "max length must be at least 2"
    )
    bench = _run(
        "bench", "--model-dir", str(MODEL), "--prompt-file", str(MODEL / "prompt.txt"), "--max-length", value
    )
    _one_line_error(bench, "max length must be at least 2")
    build = _run("build", "--model", "swift-tiny", "--out", "/nonexistent/engine", "--max-length", value)
    _one_line_error(build, "--max-length")


def test_a_huge_tree_is_refused_at_once_naming_the_tree_and_its_size():
    started = time.perf_counter()
    line = _one_line_error(
        _generate("--max-new-tokens", "3", "--tree", "300,300"), "'300,300'", "90,301 nodes"
    )
    assert "1,024" in line and "the tree auto" in line
    assert time.perf_counter() - started < 2


def test_stream_json_is_json_lines_ending_with_the_result(tmp_path, interrupted):
    result = _generate("--max-new-tokens", "24", "--seed", "3", "--ignore-eos", "--stream", "--json")
    assert result.exit_code == 0, result.output
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    increments, final = objects[:-1], objects[-1]
    assert increments and all(set(o) == {"text"} for o in increments)
    assert "".join(o["text"] for o in increments) == final["text"] and final["new_tokens"] == 24
    plain = _generate("--max-new-tokens", "24", "--seed", "3", "--ignore-eos", "--json")
    assert json.loads(plain.stdout)["token_ids"] == final["token_ids"]

    journal = tmp_path / "run.journal"
    journal.write_bytes(interrupted)
    resumed = _run("generate", "--resume", str(journal), "--stream", "--json")
    assert resumed.exit_code == 0, resumed.output
    objects = [json.loads(line) for line in resumed.stdout.splitlines()]
    assert "".join(o["text"] for o in objects[:-1]) == objects[-1]["text"] and objects[-1]["new_tokens"] == 40


def test_resume_with_another_model_or_dtype_is_refused_naming_both(tmp_path, interrupted):
    journal = tmp_path / "run.journal"
    written = interrupted
    journal.write_bytes(written)
    other = write_random_model(tmp_path / "other", seed=1)
    line = _one_line_error(
        _run("generate", "--resume", str(journal), "--model-dir", str(other)), "was written by", str(MODEL)
    )
    assert str(other) in line and "vocabulary 8192" in line and "vocabulary 258" in line
    _one_line_error(_run("generate", "--resume", str(journal), "--dtype", "bfloat16"), "--dtype float32")
    assert journal.read_bytes() == written

    # a journal from before models were recorded: its ids are checked against the vocabulary
    header = read_journal(journal).header
    header.pop("model")
    header.pop("format")
    old = tmp_path / "old.journal"
    writer = JournalWriter(old, header)
    writer.add(read_journal(journal).tokens)
    writer.close(finished=False)
    line = _one_line_error(
        _run("generate", "--resume", str(old), "--model-dir", str(other)), "outside this model"
    )
    assert "vocabulary of 258" in line
    same = _run("generate", "--resume", str(old), "--json")
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["new_tokens"] == 40


def test_a_damaged_engine_directory_is_one_line_naming_the_file_and_rebuild(tmp_path):
    engine = tmp_path / "engine"
    assert _run("build", "--model", "swift-tiny", "--out", str(engine)).exit_code == 0
    weights = engine / "model" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    args = ["generate", "--engine", str(engine), *PROMPT, "--max-new-tokens", "3"]
    _one_line_error(_run(*args), str(weights), "rebuild the engine")
    weights.write_bytes(data[:8] + bytes(len(data) - 8))  # same size, zeroed: the sha256 check
    _one_line_error(_run(*args), str(weights), "rebuild the engine")


@pytest.mark.parametrize("value", ["nan", "inf", "0.5"])
def test_bench_accept_length_must_be_a_finite_number_from_one(value):
    args = ["bench", "--model", "swift-tiny", "--random-weights", "--tree", "1,3", "--accept-length", value]
    _one_line_error(_run(*args), "--accept-length must be at least 1")


def test_resuming_a_journal_that_ended_at_eos_before_its_end_record_marks_it_finished(tmp_path):
    eos = load_config(MODEL).eos_token_ids[0]
    journal = tmp_path / "run.journal"
    header = journal_header([1, 2], GenerationConfig(max_new_tokens=40, seed=1), {"model_dir": str(MODEL)})
    writer = JournalWriter(journal, header)
    writer.add([5, eos])
    writer.close(finished=False)  # killed after the EOS record, before the end record
    _one_line_error(_generate("--max-new-tokens", "3", "--journal", str(journal)), "unfinished")
    resumed = _run("generate", "--resume", str(journal), "--json")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["token_ids"] == [5, eos] and read_journal(journal).finished
    assert _generate("--max-new-tokens", "3", "--journal", str(journal)).exit_code == 0


@pytest.mark.parametrize("option", ["--http-port", "--grpc-port", "--metrics-port"])
@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_serve_refuses_a_port_out_of_range_before_starting_anything(option, port):
    started = time.monotonic()
    result = CliRunner().invoke(main, ["serve", "--engine", str(MODEL), option, port])
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output
    assert "1<=x<=65535" in result.output and "Traceback" not in result.output
    assert time.monotonic() - started < 5  # refused by the option, before tritonserver starts


@pytest.mark.parametrize("command", ["bench", "bench-steps", "bench-serve"])
def test_a_report_directory_that_cannot_be_written_is_refused_before_the_run(tmp_path, command):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    started = time.perf_counter()
    result = _run(command, "--out", str(blocker / "report"))
    _one_line_error(result, "cannot write the report to", "give another --out")
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("value", ["-1", "2000"])
def test_kv_recent_is_judged_against_the_presets_budget_before_loading(value):
    result = _run("generate", "--model", "swift-tiny", *PROMPT, "--max-new-tokens", "3", "--kv-recent", value)
    _one_line_error(result, "recent region must be in [1, 1024)", f"got {value}")


def test_tp_on_cuda_without_a_gpu_points_at_the_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    started = time.perf_counter()
    result = _generate("--max-new-tokens", "3", "--tp", "2", "--device", "cuda")
    _one_line_error(result, "--tp 2 needs 2 GPUs, this node has 0", "with --device cpu")
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize(
    "option, value, said",
    [
        ("--device", "gpu", "unknown device 'gpu': give --device cpu or --device cuda"),
        ("--tree", "AUTO", "e.g. 1,3,3,3, or auto"),
        ("--tree", "1,1,1,1,1,1,1,1,1", "deeper than 8 levels: give at most 8 widths"),
    ],
)
def test_a_bad_device_or_tree_names_what_to_give(option, value, said):
    _one_line_error(_generate("--max-new-tokens", "3", option, value), said)


def test_draft_layers_of_another_model_are_named_as_such():
    other = MODEL.parents[0] / "heads" / "smollm2-135m.safetensors"  # SmolLM2's layers: hidden size 576
    result = _generate("--max-new-tokens", "3", "--heads", str(other))
    _one_line_error(
        result, "has shape (576,), the config implies (256,)", "belong to another model", "train-heads"
    )


def test_ar_names_the_tokenswift_options_it_ignores():
    given = _generate(
        "--max-new-tokens", "3", "--method", "ar", "--tree", "1,3,3", "--adapt-drafts", "--seed", "1"
    )
    assert given.exit_code == 0, given.output
    assert "note: --method ar ignores --tree, --adapt-drafts" in given.stderr


def test_adaptation_settings_without_adapt_drafts_are_named():
    given = _generate("--max-new-tokens", "3", "--adapt-block", "8", "--adapt-lr", "0.001", "--seed", "1")
    assert given.exit_code == 0, given.output
    assert "note: --adapt-block, --adapt-lr apply with --adapt-drafts" in given.stderr


def test_a_bad_adaptation_setting_names_its_option():
    _one_line_error(_generate("--max-new-tokens", "3", "--adapt-drafts", "--adapt-lr", "5"), "(--adapt-lr)")
    _one_line_error(
        _generate("--max-new-tokens", "3", "--adapt-drafts", "--adapt-block", "0"), "(--adapt-block)"
    )


def test_a_run_says_how_many_adaptation_steps_it_took():
    drafting = ("--tree", "1,1,1", "--draft-source", "verify", "--ignore-eos", "--seed", "1")
    adapted = _generate("--max-new-tokens", "48", *drafting, "--adapt-drafts", "--adapt-block", "4", "--json")
    static = _generate("--max-new-tokens", "48", *drafting, "--json")
    assert adapted.exit_code == 0 and static.exit_code == 0, adapted.output + static.output
    assert json.loads(adapted.stdout)["draft_updates"] > 0
    assert json.loads(static.stdout)["draft_updates"] == 0
    none = _generate("--max-new-tokens", "6", *drafting, "--adapt-drafts", "--adapt-block", "64")
    assert none.exit_code == 0, none.output
    assert ", 0 adaptation steps," in none.stderr
    assert "note: --adapt-drafts took no step" in none.stderr


def test_the_device_loop_on_a_cpu_says_the_host_loop_is_faster():
    given = _generate("--max-new-tokens", "3", "--device-loop", "--seed", "1")
    assert given.exit_code == 0, given.output
    assert "note: the device loop is CUDA's path" in given.stderr
    plain = _generate("--max-new-tokens", "3", "--method", "ar", "--seed", "1")
    assert plain.exit_code == 0 and "ignores" not in plain.stderr and plain.stdout == given.stdout

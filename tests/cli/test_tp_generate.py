"""`generate --tp 2` on the CPU (gloo): ranks started by the command itself or by torchrun emit the
single process's tokens, only rank 0 prints and journals, and a rank killed mid-generation ends the
run in one line with its journal resumable."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.multiprocessing as mp
from click.testing import CliRunner

from tokenswift_trt.cli import main
from tokenswift_trt.decode.journal import read_journal

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time, a little fox"
GREEDY = ["--temperature", "0"]
SEEDED = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]


def _args(tokens: int) -> list[str]:
    return ["generate", "--model", "swift-tiny", "--prompt", PROMPT, "--max-new-tokens", str(tokens)]


def _single(tokens: int, *more: str) -> list[int]:
    result = CliRunner().invoke(main, [*_args(tokens), "--ignore-eos", "--json", *more])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]


def _cli(*args: str, launcher: list[str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [*(launcher or [sys.executable, "-m"]), "tokenswift_trt", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_tp_size_that_splits_no_gqa_group_is_refused_in_one_line():
    result = CliRunner().invoke(main, [*_args(4), "--tp", "3"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "8 query / 2 KV heads" in lines[0] and "--tp 1, 2" in lines[0]


def test_spawned_ranks_emit_the_single_process_tokens_and_rank_0_alone_prints_and_journals(tmp_path):
    journal = tmp_path / "run.journal"
    result = _cli(*_args(64), "--ignore-eos", "--json", *SEEDED, "--tp", "2", "--journal", str(journal))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON object: the other rank printed nothing
    report = json.loads(lines[0])
    assert report["token_ids"] == _single(64, *SEEDED)  # tuned on one process, a fixed plan on two
    state = read_journal(journal)
    assert state.header["settings"]["seed"] == 5 and state.tokens == report["token_ids"]
    assert not list(tmp_path.glob("*.tmp*"))


def test_torchrun_ranks_emit_the_single_process_tokens():
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m"]
    result = _cli(*_args(48), "--ignore-eos", "--json", *GREEDY, "--tp", "2", launcher=torchrun)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["token_ids"] == _single(48, *GREEDY)


def _rank_1(parent: psutil.Process) -> psutil.Process:
    """The rank the command started."""
    for _ in range(600):
        for child in parent.children():
            try:
                if "tp_launch" in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:  # a short-lived helper process ended in between
                continue
        time.sleep(0.1)
    raise AssertionError("rank 1 never started")


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGKILL", "SIGSTOP"])  # a rank that dies, a rank that hangs
def test_a_rank_killed_mid_generation_ends_the_run_in_one_line_and_the_journal_resumes(tmp_path, stop):
    journal = tmp_path / "run.journal"
    command = [sys.executable, "-m", "tokenswift_trt", *_args(200), "--ignore-eos", *GREEDY, "--stream"]
    command += ["--tp", "2", "--tp-timeout", "10", "--journal", str(journal), "--journal-every", "4"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rank_1 = _rank_1(psutil.Process(process.pid))
        assert process.stdout is not None
        process.stdout.read(40)  # generation is under way
        rank_1.send_signal(getattr(signal, stop))
        killed = time.monotonic()
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        if rank_1.is_running():  # a stopped rank is killed by rank 0 as it fails; never left behind
            rank_1.kill()
    assert time.monotonic() - killed < 25  # bounded by the --tp-timeout (10 s)
    assert process.returncode == 2
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and "the tensor-parallel run stopped" in lines[-1]
    assert f"{journal} keeps the committed tokens" in lines[-1]
    # resumed on one process after the dead rank, on two ranks again after the hung one
    split = ["--tp", "2"] if stop == "SIGSTOP" else []
    resumed = _cli("generate", "--resume", str(journal), "--json", *split)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["token_ids"] == _single(200, *GREEDY)


def test_ranks_started_with_different_settings_refuse_in_one_line_before_loading(tmp_path):
    port = _port()
    ranks = []
    for rank, dtype in enumerate(("float32", "float64")):
        environment = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = [sys.executable, "-m", "tokenswift_trt", *_args(8), "--tp", "2", "--dtype", dtype]
        ranks.append(subprocess.Popen(command, cwd=ROOT, env=environment, stderr=subprocess.PIPE, text=True))
    errors = [process.communicate(timeout=120)[1] for process in ranks]
    assert [process.returncode for process in ranks] == [2, 2]
    assert errors[0].strip() == (
        "tokenswift-trt: error: tensor-parallel ranks disagree on --dtype: rank 0 float32, rank 1 float64: "
        "start every rank with the same command"
    )
    assert errors[1] == ""  # rank 0 reports what every rank met


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(
    not (ROOT / "models" / "smollm2-135m" / "model.safetensors").is_file(), reason="make models adds SmolLM2"
)
def test_smollm2_on_three_ranks_emits_the_single_process_tokens():
    args = ["generate", "--model", "smollm2-135m", "--prompt", "The history of the city begins"]
    args += ["--max-new-tokens", "32", "--ignore-eos", "--json", *GREEDY]
    result = _cli(*args, "--tp", "3", timeout=900)
    assert result.returncode == 0, result.stderr
    single = CliRunner().invoke(main, args)
    assert single.exit_code == 0, single.output
    tokens = [json.loads(out.strip().splitlines()[-1])["token_ids"] for out in (result.stdout, single.stdout)]
    assert tokens[0] == tokens[1]
    refused = CliRunner().invoke(main, [*args, "--tp", "2"])
    assert refused.exit_code == 2 and "9 query / 3 KV heads" in refused.output
    assert "--tp 1, 3" in refused.output


@pytest.mark.slow
def test_an_engine_directory_runs_on_two_ranks_with_the_single_process_tokens(tmp_path):
    engine = tmp_path / "engine"
    built = CliRunner().invoke(
        main, ["build", "--model", "models/swift-tiny", "--out", str(engine), "--dtype", "float32"]
    )
    assert built.exit_code == 0, built.output
    args = ["generate", "--engine", str(engine), "--prompt", PROMPT, "--max-new-tokens", "48"]
    args += ["--ignore-eos", "--json", *SEEDED]
    result = _cli(*args, "--tp", "2")
    assert result.returncode == 0, result.stderr
    single = CliRunner().invoke(main, args)
    assert single.exit_code == 0, single.output
    tokens = [json.loads(out.strip().splitlines()[-1])["token_ids"] for out in (result.stdout, single.stdout)]
    assert tokens[0] == tokens[1]


def _check_tokens_rank(rank: int, port: int, last: int, results) -> None:
    import torch.distributed as dist

    from tokenswift_trt.cli.tp_launch import Ranks
    from tokenswift_trt.model.tensor_parallel import TensorParallelError, init_group

    ranks = Ranks(init_group(rank, 2, "127.0.0.1", port, timeout_s=60), "cpu")
    ranks.check_tokens([4, 5, 6])  # the same on both ranks: passes
    try:
        ranks.check_tokens([4, 5, last])
        results.put((rank, None))
    except TensorParallelError as error:
        results.put((rank, str(error)))
    dist.destroy_process_group()


def test_ranks_that_commit_different_tokens_fail_on_every_rank_in_one_line():
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _port()
    processes = [context.Process(target=_check_tokens_rank, args=(r, port, 6 + r, results)) for r in range(2)]
    for process in processes:
        process.start()
    try:
        errors = dict(results.get(timeout=120) for _ in processes)
    finally:
        for process in processes:
            process.join(30)
    assert errors[0] == errors[1] and "ranks committed different tokens" in errors[0]
    assert "\n" not in errors[0]

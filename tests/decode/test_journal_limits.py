"""A journal on a full disk (here: a file size limit, `ulimit -f`) fails in one line and keeps every
record written before; a request id is held by one process at a time, and the others are told who."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenswift_trt.decode.journal import (
    JournalError,
    JournalHeld,
    JournalLock,
    check_journal_room,
    read_journal,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "swift-tiny"


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, **kwargs
    )


def test_a_journal_write_past_the_file_size_limit_says_so_and_keeps_what_was_written(tmp_path):
    path = tmp_path / "run.journal"
    result = _python(
        f"""
        import resource
        from tokenswift_trt.decode.journal import JournalError, JournalWriter, journal_header
        from tokenswift_trt.decode.config import GenerationConfig

        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        header = journal_header([1, 2], GenerationConfig(max_new_tokens=9000, seed=3))
        writer = JournalWriter({str(path)!r}, header, every=8)
        written = 0
        try:
            while True:
                writer.add(list(range(1000, 1008)))
                written += 8
        except JournalError as error:
            print(written)
            print(error)
        try:
            writer.close(finished=False)
        except JournalError:
            pass
        """
    )
    assert result.returncode == 0, result.stderr
    written, message = result.stdout.strip().splitlines()
    assert "cannot write the journal" in message and "File too large" in message and "resume" in message
    state = read_journal(path)  # every record written before the failure is intact
    assert len(state.tokens) == int(written) > 0 and not state.finished


def test_a_journal_the_file_size_limit_cannot_hold_is_refused_before_work(tmp_path):
    check_journal_room(tmp_path / "ok.journal", 1000)
    result = _python(
        f"""
        import resource
        from tokenswift_trt.decode.journal import JournalError, check_journal_room

        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
        check_journal_room({str(tmp_path / "small.journal")!r}, 1000)
        try:
            check_journal_room({str(tmp_path / "big.journal")!r}, 100000)
        except JournalError as error:
            print(error)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "ulimit -f" in result.stdout and "100000 tokens" in result.stdout
    assert not (tmp_path / "big.journal").exists()


@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="models/swift-tiny is not here")
def test_generate_refuses_a_journal_the_file_size_limit_cannot_hold_before_loading(tmp_path):
    journal = tmp_path / "run.journal"
    cli = [sys.executable, "-m", "tokenswift_trt", "generate", "--model-dir", str(MODEL), "--prompt", "Once"]
    args = [*cli, "--temperature", "0", "--ignore-eos", "--journal", str(journal)]
    # refused before any work: the limit cannot hold the journal of 200,000 tokens
    refused = subprocess.run(
        ["bash", "-c", 'ulimit -f 64; exec "$@"', "_", *args, "--max-new-tokens", "200000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2 and "ulimit -f" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not journal.exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (a device whose writes fail ENOSPC)")
@pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="models/swift-tiny is not here")
def test_a_disk_that_fills_mid_run_stops_in_one_line_and_the_journal_resumes(tmp_path):
    from tokenswift_trt.api import ApiError, load, resume_run, start_run
    from tokenswift_trt.decode.request import config_from

    journal = tmp_path / "run.journal"
    model = load(model_dir=MODEL)
    config = config_from({}, {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True, "method": "ar"})
    run = start_run(model, "Once upon a time", config, journal=journal, journal_every=16)
    run.writer.handle.close()  # from here the journal's disk is full: every write fails with ENOSPC
    run.writer.handle = open("/dev/full", "ab")  # noqa: SIM115 (the writer closes it)
    with pytest.raises(
        ApiError, match=r"cannot write the journal .*No space left on device.*resume"
    ) as caught:
        run.execute()
    assert "\n" not in str(caught.value)
    assert not read_journal(journal).finished  # the header (and nothing torn) is still there
    resumed = resume_run(journal, model).execute()
    assert resumed.token_ids == start_run(model, "Once upon a time", config).execute().token_ids


def test_a_request_id_is_held_by_one_process_and_the_others_are_told_which(tmp_path):
    path = tmp_path / "job.journal"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from tokenswift_trt.decode.journal import JournalLock\n"
            f"lock = JournalLock({str(path)!r}, holder='the server of models/a')\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JournalHeld, match=rf"the server of models/a \(pid {holder.pid} on .*\) since"):
            JournalLock(path, holder="another server")
    finally:
        holder.kill()  # SIGKILL: the lock ends with its holder
        holder.wait()
    lock = JournalLock(path, holder="this one")
    assert json.loads(Path(str(path) + ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(JournalHeld, match="by this server since"):
        JournalLock(path, holder="this one")  # a second request with the same id, in this process
    lock.release()
    lock.release()  # idempotent
    JournalLock(path, holder="this one").release()


def test_a_lock_where_nothing_can_be_written_is_a_journal_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(JournalError, match="is a file, not a directory"):
        JournalLock(blocker / "job.journal", holder="x")

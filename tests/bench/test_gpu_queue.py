"""scripts/gpu_queue.sh: GPU stages in the background while later device calls carry the GGUF's parts.

Runs the script itself in a scratch checkout whose gpu_checks.sh only records the stages it was given
(the stages need a GPU; what is under test is the queue: the order, the wait for the parts, the
refusal on a bare machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_queue.sh", repo / "scripts" / "gpu_queue.sh")
    (repo / "scripts" / "gpu_checks.sh").write_text('out=$1; shift; echo "$*" >> "$out/ran.txt"\n')
    return repo


def queue(repo: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_queue.sh"), *args], capture_output=True, text=True, env=env,
        timeout=60,
    )


def wait_for(path: Path, text: str, seconds: float = 20) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return path.read_text()
        time.sleep(0.2)
    raise AssertionError(f"{path} never held {text!r}")


def test_queue_runs_stages_at_once_then_the_model_stages_once_every_part_is_there(tmp_path):
    repo, out, back = make_checkout(tmp_path), tmp_path / "g", tmp_path / "back"
    back.mkdir()
    env = {**os.environ, "GPU_QUEUE_DIR": str(tmp_path / "queue"), "OUT": str(back)}
    (repo / ".gpu_carry").mkdir()
    (repo / ".gpu_carry" / "smol.part0").write_text("0")

    started = queue(repo, env, "start", str(out), "env prefix-sweep", "smollm2")
    assert started.returncode == 0, started.stderr
    assert wait_for(out / "ran.txt", "env prefix-sweep") == "env prefix-sweep\n"
    time.sleep(2.5)  # the queue polls every 2 s: with one part of three the model stages wait
    assert "smollm2" not in (out / "ran.txt").read_text() and not (out / "DONE").exists()

    for part in (1, 2):  # the next calls carry one part each
        (repo / ".gpu_carry" / f"smol.part{part}").write_text(str(part))
        added = queue(repo, env, "add")
        assert added.returncode == 0, added.stderr
    assert (tmp_path / "queue" / ".gpu_carry" / "parts_ready").is_file()
    waited = queue(repo, env, "wait", "30")
    assert waited.returncode == 0 and "done" in waited.stdout
    assert (out / "ran.txt").read_text() == "env prefix-sweep\nsmollm2\n"
    assert (back / "queue.tgz").is_file()


def test_add_and_wait_stop_at_once_on_a_machine_without_the_queue(tmp_path):
    repo = make_checkout(tmp_path)
    env = {**os.environ, "GPU_QUEUE_DIR": str(tmp_path / "absent")}
    for args in (("add",), ("wait", "600")):
        begun = time.monotonic()
        result = queue(repo, env, *args)
        assert result.returncode == 3 and "bare" in result.stdout
        assert time.monotonic() - begun < 30  # not the 600 s a bare machine once cost

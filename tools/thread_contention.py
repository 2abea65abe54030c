"""Generation speed on a shared CPU: the default thread count against fixed counts, idle, beside a busy
neighbour, beside a neighbour that leaves, and as two processes at once.

    .venv/bin/python -m tools.thread_contention --out docs/bench/cpu-threads-contention

Each case runs `tokenswift-trt generate --json` as a user would (a new process per run, the speed its
JSON reports, load time excluded), the thread settings taking turns within each repeat. The neighbour
is a single-threaded Python busy loop. Writes OUT/threads.json (runs, medians and the machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tokenswift_trt.decode.threads import usable_cpus
from tokenswift_trt.environment import cpu_model

BUSY_LOOP = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "tokenswift_trt"]


def _neighbour(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(seconds=seconds)])


def _generate(model: str, tokens: int, threads: str, prompt: str) -> subprocess.Popen:
    command = [*CLI, "generate", "--model", model, "--prompt", prompt, "--max-new-tokens", str(tokens)]
    command += ["--ignore-eos", "--seed", "1", "--json", "--threads", threads]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _result(process: subprocess.Popen, launched: float) -> dict:
    out, _ = process.communicate()
    wall = time.perf_counter() - launched
    if process.returncode != 0:
        raise SystemExit(f"generate failed ({process.returncode}): {out[-500:]}")
    record = json.loads(out[out.index("{") :])
    return {
        "elapsed_s": record["elapsed_s"],
        "startup_s": wall - record["elapsed_s"],  # interpreter, imports and loading before generation
        "tokens_per_s": record["tokens_per_s"],
        "thread_switches": record["thread_switches"],
        "token_ids_head": record["token_ids"][:8],
        "token_ids": record["token_ids"],
    }


def run_case(case: str, model: str, tokens: int, threads: str, prompt: str, leave_after: float) -> dict:
    """One generation (two for `two-processes`) under the case's load."""
    neighbour = None
    if case == "busy":
        neighbour = _neighbour(600)
    elif case == "neighbour-leaves":
        neighbour = _neighbour(leave_after)
    if neighbour is not None:
        time.sleep(0.5)  # the neighbour is running before the generation starts
    try:
        if case == "two-processes":
            launched = time.perf_counter()
            first = _generate(model, tokens, threads, prompt)
            second = _generate(model, tokens, threads, prompt)
            results = [_result(first, launched), _result(second, launched)]
            return {
                "elapsed_s": max(r["elapsed_s"] for r in results),
                "tokens_per_s": sum(r["tokens_per_s"] for r in results),
                "thread_switches": sum(r["thread_switches"] for r in results),
                "token_ids": results[0]["token_ids"],
                "same_tokens_both": results[0]["token_ids"] == results[1]["token_ids"],
            }
        launched = time.perf_counter()
        return _result(_generate(model, tokens, threads, prompt), launched)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="swift-tiny:1024,smollm2-135m:256", help="preset:tokens,...")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="idle,busy,neighbour-leaves,two-processes")
    parser.add_argument("--prompt", default="It is a truth universally acknowledged, that a single man")
    args = parser.parse_args()
    cpus = usable_cpus()
    settings = ["auto", "1", str(cpus)] if cpus > 1 else ["auto", "1"]
    load_before = os.getloadavg()
    rows = []
    for item in args.models.split(","):
        model, tokens = item.split(":")
        for case in args.cases.split(","):
            # the neighbour leaves a third of the way into the 1-thread run of the idle case
            leave_after = 0.0
            if case == "neighbour-leaves":
                idle_one = [
                    r for r in rows if r["model"] == model and r["case"] == "idle" and r["threads"] == "1"
                ]
                # a third of the way into the generation: the idle run's start-up, then its speed
                leave_after = 0.5 + (
                    idle_one[0]["startup_s"] + idle_one[0]["elapsed_s"] / 3 if idle_one else 5.0
                )
            for repeat in range(args.repeats):
                for threads in settings:
                    result = run_case(case, model, int(tokens), threads, args.prompt, leave_after)
                    rows.append(
                        {
                            "model": model,
                            "tokens": int(tokens),
                            "case": case,
                            "threads": threads,
                            "repeat": repeat,
                            "leave_after_s": leave_after or None,
                            **result,
                        }
                    )
                    print(
                        f"{model} {case} threads={threads}: {result['elapsed_s']:.2f} s "
                        f"({result['thread_switches']} switches)",
                        flush=True,
                    )
    summary = []
    for item in args.models.split(","):
        model = item.split(":")[0]
        for case in args.cases.split(","):
            cell = {"model": model, "case": case}
            reference = None
            for threads in settings:
                times = [
                    r["elapsed_s"]
                    for r in rows
                    if (r["model"], r["case"], r["threads"]) == (model, case, threads)
                ]
                ids = [
                    r["token_ids"]
                    for r in rows
                    if (r["model"], r["case"], r["threads"]) == (model, case, threads)
                ]
                cell[f"threads={threads}_s"] = round(min(times), 3)
                reference = reference or ids[0]
                cell.setdefault("same_tokens", True)
                cell["same_tokens"] &= all(i == reference for i in ids)
            cell["auto_over_one_thread"] = round(cell["threads=auto_s"] / cell["threads=1_s"], 3)
            if cpus > 1:
                cell[f"auto_over_{cpus}_threads"] = round(
                    cell["threads=auto_s"] / cell[f"threads={cpus}_s"], 3
                )
            summary.append(cell)
    for row in rows:
        row.pop("token_ids")
    record = {
        "command": "python -m tools.thread_contention " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_model(), "usable_cpus": cpus, "torch": torch.__version__, "gpu": None},
        "load_average_before": load_before,
        "neighbour": "one single-threaded Python busy loop",
        "summary": summary,
        "runs": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "threads.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

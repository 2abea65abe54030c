"""One prepared check of a GPU machine, in one call of at most ~9 minutes, most valuable stages first.

    python -m tools.gpu_check OUT [--device cpu] [--stages a,b] [--budget-s S]
    bash scripts/gpu_checks.sh OUT prepared [--device cpu]           (the same)

Stages, in order: `carry` (gather the SmolLM2 parts carried under .carry/smollm2-*/ into a stash
outside the checkout, which stays while the machine does), `env` (GPU, driver, torch, CUDA, copy
bandwidth, our kernels built), `smollm2-import` (join the parts, import the GGUF into
models/smollm2-135m), SmolLM2-135M with its committed draft layers end to end (AR and TokenSwift
taking turns through the device loop, tree 3,3,3 with 4 n-gram branches; paper sampling in bf16
first), the 8B shape's AR step and iteration at 4K-98K prompt tokens (random weights), `model` (the
~94K-token generation modeled from those times at the trie's cap and at the τ measured on SmolLM2,
never above the cap), `adapt-cost` (SmolLM2's device-loop iteration with its draft layers adapting
on a side stream against without, by turns), swift-tiny end to end, SmolLM2's iteration phase by
phase, the GPU tests, then greedy and float32 variants, the 100-slot trie, and `tp` (swift-tiny on
one GPU and on two tensor-parallel ranks, compared; skipped with fewer than 2 GPUs).

Every stage runs in its own process group with its own time limit, inside the run's budget: a stage
is not started with less time left than it needs, and says so. OUT gets four files, rewritten after
every stage so that a run cut off still leaves what it measured: run.json (machine, git commit,
command, each stage's status, seconds and skip reason, the figures), summary.md (the same as tables),
run.log (each stage's log tail) and results.tar.gz (every stage's full output). `--device cpu` runs
every stage at tiny sizes (the 8B shape is swift-tiny's there, the tests are only collected): a dry
run of the plumbing in a minute or two.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenswift_trt.environment import child_environment, gpu_check_command
from tools.remodel import Tau, ar_floor_ms, capped, remodel, run_tau, trie_cap

REPOSITORY = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = Path("models/smollm2-135m")
# folders of SmolLM2 parts under .carry/, each carried by one call (scripts/prepare_carry.sh)
CARRY_PATTERN = "smollm2-[0-9]*"
DEFAULT_STASH = Path("/tmp/tokenswift-carry/smollm2")
SHORT_NAMES = {"smollm2-135m": "smollm2"}
PROMPT = Path("models/swift-tiny/prompt.txt")  # held out of both models' training (Pride and Prejudice)
TESTS = (
    "tests/plugins_cuda/test_cuda_kernels.py",
    "tests/decode/test_static_step.py",
    "tests/model/test_sampling.py",
    "tests/kernels/test_kernels.py",
    "tests/model/test_model.py",
    "tests/tools/test_bench_kernels.py",
    "tests/bench/test_steps.py",
    "tests/model/test_kv_cache.py",
    "tests/kernels/test_transfer.py",
    "tests/decode/test_device_loop.py",
    "tests/decode/test_executors.py",
    "tests/decode/test_draft_adaptation.py::test_the_side_stream_update_keeps_ars_tokens_on_cuda",
    "tests/decode/test_draft_adaptation.py::test_graphs_are_captured_again_as_the_request_head_grows_on_cuda",
    "tests/decode/test_draft_adaptation.py::test_a_step_is_drafted_with_from_the_next_steps_launch_on_cuda",
    "tests/kernels/test_fused_elementwise.py",
    "tests/kernels/test_cascade.py",
    "tests/kernels/test_triton_prefix.py",
    "tests/kernels/test_triton_linear.py",
    "tests/kernels/test_triton_aligned.py",
)
OUT_FILES = ("run.json", "summary.md", "run.log", "results.tar.gz")
LOG_TAIL = 80  # lines of each stage's log in run.log


@dataclass(frozen=True)
class Sizes:
    """What the stages run at: a GPU's sizes, or a CPU dry run's."""

    device: str
    budget_s: int
    min_scale: float  # share of a stage's minimum time it needs left to start (0: never skipped for time)
    smollm2_prefix: int
    smollm2_gen: str
    tiny_prefix: int
    tiny_gen: str
    interleave: int
    shape_model: str  # whose shape the "8b" stages time with random weights
    shape_contexts: str
    shape_wide_contexts: str
    shape_gen: str  # two lengths: the steady time per token is taken between them
    shape_interleave: int
    phase_context: str
    phase_iterations: int
    adapt_gen: str  # new tokens of the adaptation-cost run
    shape_window: int = 1024  # the 8B preset's penalty window


GPU = Sizes(
    device="cuda",
    budget_s=500,
    min_scale=1.0,
    smollm2_prefix=256,
    smollm2_gen="1024,4096,7936",  # 256 + 7,936 = the model's 8,192 positions
    tiny_prefix=256,
    tiny_gen="1024,4096,8192",
    interleave=512,
    shape_model="llama3.1-8b",
    shape_contexts="4096,32768;65536,98304",  # ";" separates the groups, one `bench` each
    shape_wide_contexts="4096;98304",
    shape_gen="64,320",
    shape_interleave=160,
    phase_context="4096",
    phase_iterations=16,
    adapt_gen="1024",
)
DRY = Sizes(
    device="cpu",
    budget_s=600,
    min_scale=0.0,
    smollm2_prefix=32,
    smollm2_gen="2,4",
    tiny_prefix=64,
    tiny_gen="8,24",
    interleave=8,
    shape_model="swift-tiny",
    shape_contexts="32,64;96,128",
    shape_wide_contexts="32;128",
    shape_gen="8,24",
    shape_interleave=12,
    phase_context="128",
    phase_iterations=2,
    adapt_gen="24",
)


@dataclass(frozen=True)
class Skip:
    """A stage that does not run: why (ok: nothing to do, e.g. the model is already imported)."""

    reason: str
    ok: bool = False


Commands = list[list[str]]


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    limit_s: int
    min_s: int
    plan: Callable[[Check], Commands | Skip] | None = None  # commands run one after another
    inline: Callable[[Check], dict[str, Any]] | None = None  # or work done in this process
    summarize: Callable[[Check], dict[str, Any] | None] | None = None


@dataclass
class Check:
    """One run: where it writes, its sizes and budget, and the record that becomes run.json."""

    out: Path
    work: Path
    sizes: Sizes
    stash: Path
    command: str
    echo: Callable[[str], None]
    carry: Path = REPOSITORY / ".carry"  # where the calls put the parts they carry
    given_commit: str | None = None  # recorded where the copy has no .git
    python: str = sys.executable
    started: float = field(default_factory=time.monotonic)
    record: dict[str, Any] = field(default_factory=dict)
    child: subprocess.Popen | None = None
    modeled: bool = False  # the model stage has run: the modeling is redone at every save

    @property
    def cuda(self) -> bool:
        return self.sizes.device.startswith("cuda")

    def left_s(self) -> float:
        return self.sizes.budget_s - (time.monotonic() - self.started)

    def cli(self, *args: str) -> list[str]:
        return [self.python, "-m", "tokenswift_trt.cli", *args]

    def stage_dir(self, name: str) -> Path:
        return self.work / name

    # ---------------------------------------------------------------- record

    def stage_record(self, name: str) -> dict[str, Any]:
        return next(entry for entry in self.record["stages"] if entry["name"] == name)

    def save(self) -> None:
        """run.json, summary.md and results.tar.gz as they stand (run.log is appended stage by stage)."""
        self.record["updated"] = utc_now()
        self.record["elapsed_s"] = round(time.monotonic() - self.started, 1)
        env = self.record["results"].get("env")
        if env:
            self.record["machine"].update(env)
        if self.modeled:
            self.record["modeled"] = modeled_figures(self)
        write_atomic(self.out / "run.json", json.dumps(self.record, indent=2) + "\n")
        write_atomic(self.out / "summary.md", summary_markdown(self.record))
        partial = self.out / "results.tar.gz.partial"
        with tarfile.open(partial, "w:gz") as archive:
            archive.add(self.work, arcname="results")
        partial.replace(self.out / "results.tar.gz")

    def append_log(self, name: str, status: str, seconds: float) -> None:
        log = self.work / f"{name}.log"
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL:] if log.is_file() else []
        with open(self.out / "run.log", "a") as handle:
            handle.write(f"== {name}: {status} after {seconds:.1f}s\n" + "".join(f"{ln}\n" for ln in lines))

    # ---------------------------------------------------------------- running

    def run_commands(self, name: str, commands: Commands, timeout_s: float) -> tuple[str, int | None]:
        """Each command in turn in its own process group, logged to WORK/NAME.log, all within timeout_s;
        ("ok" | "failed" | "timeout", the last exit code)."""
        deadline = time.monotonic() + timeout_s
        environment = child_environment()
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPOSITORY), environment.get("PYTHONPATH")])
        )
        environment["PYTHONUNBUFFERED"] = "1"
        with open(self.work / f"{name}.log", "a") as log:
            for command in commands:
                log.write(f"$ {shlex.join(command)}\n")
                log.flush()
                self.child = subprocess.Popen(
                    command,
                    cwd=REPOSITORY,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    start_new_session=True,
                )
                try:
                    code = self.child.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.stop_child()
                    return "timeout", None
                finally:
                    self.child = None
                if code != 0:
                    return "failed", code
        return "ok", 0

    def stop_child(self) -> None:
        """End the running stage's whole process group (SIGTERM, then SIGKILL after 5 s)."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                return
            try:
                child.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def run_stage(self, stage: Stage) -> None:
        entry = self.stage_record(stage.name)
        start = time.monotonic()
        plan: Commands | Skip | None = stage.plan(self) if stage.plan else None
        needed = stage.min_s * self.sizes.min_scale
        if isinstance(plan, Skip):
            entry.update(status="ok" if plan.ok else "skipped", reason=None if plan.ok else plan.reason)
            if plan.ok:
                entry["note"] = plan.reason
        elif self.left_s() < needed:
            entry.update(
                status="skipped",
                reason=f"out of time: {self.left_s():.0f}s of the {self.sizes.budget_s}s budget left, "
                f"the stage needs at least {stage.min_s}s",
            )
        else:
            timeout_s = min(stage.limit_s, max(1.0, self.left_s()))
            entry.update(status="running", limit_s=round(timeout_s), started=utc_now())
            self.echo(f"== {stage.name} (limit {timeout_s:.0f}s): {stage.what}")
            self.save()
            if stage.inline is not None:
                try:
                    entry.update(stage.inline(self))
                except Exception as error:  # noqa: BLE001 - one stage's failure must not end the run
                    entry.update(status="failed", reason=f"{type(error).__name__}: {error}".splitlines()[0])
            else:
                assert isinstance(plan, list)
                entry["commands"] = [shlex.join(command) for command in plan]
                status, code = self.run_commands(stage.name, plan, timeout_s)
                entry.update(status=status, returncode=code, log=f"results/{stage.name}.log")
                if status == "timeout":
                    entry["reason"] = f"stopped at its time limit of {timeout_s:.0f}s"
                elif status == "failed":
                    entry["reason"] = f"exit code {code}: {last_line(self.work / f'{stage.name}.log')}"
        if stage.summarize is not None:
            try:
                summary = stage.summarize(self)
            except (OSError, ValueError, KeyError) as error:
                summary = {"unreadable": f"{type(error).__name__}: {error}"}
            if summary is not None:
                self.record["results"][stage.name] = summary
        entry["seconds"] = round(time.monotonic() - start, 1)
        self.echo(
            f"== {stage.name}: {entry['status']} after {entry['seconds']}s"
            + (f" ({entry['reason']})" if entry.get("reason") else "")
        )
        self.append_log(stage.name, entry["status"], entry["seconds"])
        self.save()


# ---------------------------------------------------------------- helpers


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def last_line(log: Path) -> str:
    lines = (
        [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if log.is_file()
        else []
    )
    return lines[-1][:300] if lines else "(no output)"


def git_commit(given: str | None = None) -> dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it; `given` (--git-commit) where the
    copy has no .git (the device machine gets the working tree without it)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPOSITORY,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPOSITORY,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return {"commit": head, "tracked_changes": bool(dirty)}
    except (subprocess.SubprocessError, OSError):
        if given:
            return {"commit": given, "from": "--git-commit"}
        return {"commit": "unknown: no .git in this copy (pass --git-commit HASH)"}


def machine() -> dict[str, Any]:
    """What is known before any stage runs (no CUDA context in this process)."""
    import platform

    from tools.gpu_env import nvidia_smi

    record: dict[str, Any] = {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **nvidia_smi(),
    }
    try:
        import torch

        record.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    except ImportError:
        record["torch"] = "not installed"
    return record


def read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------- stages: carrying SmolLM2


def carried_folders(carry: Path) -> list[Path]:
    return sorted(path for path in carry.glob(CARRY_PATTERN) if path.is_dir())


def gather_parts(check: Check) -> dict[str, Any]:
    """Copy the carried SmolLM2 parts (and their manifest) into the stash; which parts it then holds."""
    from tokenswift_trt.builder.pack import MANIFEST, PackError, PackManifest

    check.stash.mkdir(parents=True, exist_ok=True)
    copied = []
    for folder in carried_folders(check.carry):
        for path in sorted([folder / MANIFEST, *folder.glob("part-*.bin")]):
            target = check.stash / path.name
            if path.is_file() and not (target.is_file() and target.stat().st_size == path.stat().st_size):
                shutil.copyfile(path, target)
                copied.append(f"{folder.name}/{path.name}")
    if not (check.stash / MANIFEST).is_file():
        return {
            "status": "skipped",
            "reason": f"no SmolLM2 parts carried ({check.carry}/{CARRY_PATTERN}) nor in {check.stash}: "
            "prepare them with scripts/prepare_carry.sh and carry each folder in back-to-back calls",
        }
    try:
        manifest = PackManifest.read(check.stash)
    except PackError as error:
        return {"status": "failed", "reason": str(error)}
    missing = [
        part.name
        for part in manifest.parts
        if not ((check.stash / part.name).is_file() and (check.stash / part.name).stat().st_size == part.size)
    ]
    result: dict[str, Any] = {
        "status": "ok",
        "stash": str(check.stash),
        "copied": copied,
        "parts": len(manifest.parts),
        "missing": missing,
        "bytes": manifest.total_bytes,
    }
    if missing:
        result["note"] = (
            f"{len(missing)} of {len(manifest.parts)} parts missing ({', '.join(missing)}): the calls that "
            "carried them ran on another machine, or were not made"
        )
    return result


def smollm2_ready() -> bool:
    return (REPOSITORY / SMOLLM2_DIR / "config.json").is_file() and (
        REPOSITORY / SMOLLM2_DIR / "gguf_source.json"
    ).is_file()


def import_plan(check: Check) -> Commands | Skip:
    if smollm2_ready():
        return Skip(f"{SMOLLM2_DIR} is already imported", ok=True)
    carry = check.stage_record("carry")
    if carry.get("status") != "ok" or carry.get("missing"):
        why = carry.get("reason") or carry.get("note") or "the carry stage did not run"
        return Skip(f"{SMOLLM2_DIR} is missing and cannot be imported: {why}")
    source, site = check.stash.parent / "smollm2-src", check.stash.parent / "site"
    join = check.cli("pack", "join", str(check.stash), "--out", str(source), "--force")
    script = (
        f"set -e; {shlex.join(join)}; "
        f"{shlex.quote(check.python)} -m pip install -q --no-index --no-deps --no-compile --upgrade "
        f"--target {shlex.quote(str(site))} {shlex.quote(str(source))}/*.whl; "
        f"PYTHONPATH={shlex.quote(str(site))}:$PYTHONPATH {shlex.quote(check.python)} "
        f"-m tokenswift_trt.builder.smollm2 --out {SMOLLM2_DIR}"
    )
    return [["bash", "-c", script]]


# ---------------------------------------------------------------- stages: end to end


@dataclass(frozen=True)
class EndToEnd:
    """AR and TokenSwift taking turns on a trained model through the device loop (`bench`)."""

    model: str  # preset
    sampling: str  # "paper" | "greedy"
    dtype: str
    tree: str = "3,3,3"
    ngram_topk: int = 4

    def sampling_flags(self, window: int) -> list[str]:
        if self.sampling == "greedy":
            return ["--temperature", "0", "--penalty", "1"]
        return ["--min-p", "0.1", "--penalty", "1.2", "--penalty-window", str(window)]

    def plan(self, check: Check) -> Commands | Skip:
        sizes = check.sizes
        prefix, gen = (
            (sizes.smollm2_prefix, sizes.smollm2_gen)
            if self.model == "smollm2-135m"
            else (sizes.tiny_prefix, sizes.tiny_gen)
        )
        return self.bench(check, prefix, gen, check.work / self.name, ["--device-loop"])

    def bench(self, check: Check, prefix: int, gen: str, out: Path, flags: list[str]) -> Commands | Skip:
        """One `bench` of this model, sampling and tree by turns with AR (`flags`: the loop and any
        other options), or why not (SmolLM2 not imported)."""
        if self.model == "smollm2-135m" and not smollm2_ready():
            why = check.stage_record("smollm2-import").get("reason") or "not imported"
            return Skip(f"{SMOLLM2_DIR} is missing: {why}")
        return [
            check.cli(
                "bench",
                "--model",
                self.model,
                "--prompt-file",
                str(PROMPT),
                "--device",
                check.sizes.device,
                "--dtype",
                self.dtype if check.cuda else "float32",  # a dry run: bf16 on a CPU is slow
                "--tree",
                self.tree,
                "--ngram-topk",
                str(self.ngram_topk),
                *flags,
                "--gen-len",
                gen,
                "--prefix-len",
                str(prefix),
                "--interleave",
                str(check.sizes.interleave),
                "--no-extras",
                *self.sampling_flags(256),
                "--seed",
                "1",
                "--ignore-eos",
                "--out",
                str(out),
            )
        ]

    @property
    def name(self) -> str:
        dtype = {"bfloat16": "bf16", "float32": "f32"}.get(self.dtype, self.dtype)
        return f"{SHORT_NAMES.get(self.model, self.model)}-{self.sampling}-{dtype}"

    def summarize(self, check: Check) -> dict[str, Any] | None:
        report = read_json(check.work / self.name / "bench.json")
        if report is None:
            return None
        keys = (
            "prefix_len",
            "gen_len",
            "ar_tokens_per_s",
            "tokenswift_tokens_per_s",
            "speedup",
            "tokens_per_iteration",
            "alpha",
            "alpha_by_depth",
            "ar_decode_ms_per_iteration",
            "tokenswift_decode_ms_per_iteration",
            "tokens_equal_ar",
        )
        meta = report["meta"]
        return {
            "model": self.model,
            "sampling": self.sampling,
            "dtype": meta.get("dtype"),
            "tree": meta.get("tree"),
            "ngram_topk": meta.get("ngram_topk"),
            "command": meta.get("command"),
            "rows": [{key: row.get(key) for key in keys} for row in report["rows"]],
            "tau": run_tau(report["rows"]),
        }

    def stage(self, limit_s: int, min_s: int) -> Stage:
        what = (
            f"{self.model} end to end, {self.sampling} sampling, {self.dtype}: AR and TokenSwift by turns "
            f"(device loop, tree {self.tree}, {self.ngram_topk} n-gram branches)"
        )
        return Stage(self.name, what, limit_s, min_s, plan=self.plan, summarize=self.summarize)


# ---------------------------------------------------------------- stages: the 8B shape


@dataclass(frozen=True)
class Shape:
    """The 8B shape (random weights): AR step and device-loop iteration times per prompt length, one
    `bench` per group of prompt lengths (shortest first), so that a later group failing (too little
    memory at ~100K) or cut off leaves the earlier groups' rows."""

    name: str
    ngram_topk: int
    wide: bool  # the larger trie, at the shortest and longest prompt lengths only
    tree: str = "3,3,3"

    def groups(self, sizes: Sizes) -> list[str]:
        return (sizes.shape_wide_contexts if self.wide else sizes.shape_contexts).split(";")

    def plan(self, check: Check) -> Commands:
        sizes = check.sizes
        dtype = "bfloat16" if check.cuda else "float32"
        return [
            check.cli(
                *f"bench --model {sizes.shape_model} --random-weights --device {sizes.device}".split(),
                *f"--dtype {dtype} --tree {self.tree} --ngram-topk {self.ngram_topk}".split(),
                *f"--device-loop --no-extras --gen-len {sizes.shape_gen} --prefix-len {contexts}".split(),
                *f"--interleave {sizes.shape_interleave} --min-p 0.1 --penalty 1.2 --seed 1".split(),
                *f"--penalty-window {sizes.shape_window} --accept-length {trie_cap(self.tree)}".split(),
                "--out",
                str(check.work / self.name / f"group-{index}"),
            )
            for index, contexts in enumerate(self.groups(sizes), 1)
        ]

    def report(self, check: Check) -> dict[str, Any] | None:
        """The groups' bench reports as one (the first group's meta, every finished group's rows)."""
        reports = [read_json(path) for path in sorted((check.work / self.name).glob("group-*/bench.json"))]
        reports = [report for report in reports if report]
        if not reports:
            return None
        rows = [row for report in reports for row in report["rows"]]
        return {
            "meta": reports[0]["meta"],
            "rows": sorted(rows, key=lambda row: (row["prefix_len"], row["gen_len"])),
        }

    def summarize(self, check: Check) -> dict[str, Any] | None:
        report = self.report(check)
        if report is None:
            return None
        return {
            "model": check.sizes.shape_model,
            "tree": self.tree,
            "ngram_topk": self.ngram_topk,
            "prompt_lengths": sorted({row["prefix_len"] for row in report["rows"]}),
        }

    def stage(self, limit_s: int, min_s: int) -> Stage:
        contexts = "the shortest and longest" if self.wide else "four"
        what = (
            f"the 8B shape (random weights): AR step and iteration (tree {self.tree}, {self.ngram_topk} "
            f"n-gram branches) at {contexts} prompt lengths"
        )
        return Stage(self.name, what, limit_s, min_s, plan=self.plan, summarize=self.summarize)


SHAPES = (Shape("8b-k4", 4, wide=False), Shape("8b-k20", 20, wide=True))
SMOLLM2_TAU_STAGE = "smollm2-paper-bf16"
TINY_TAU_STAGE = "swift-tiny-paper-bf16"


def modeled_figures(check: Check) -> dict[str, Any]:
    """Each measured 8B run: AR against its floor per prompt length, and the modeled speedups (per
    prompt length and for the generation from the shortest to the longest) at the trie's cap, at the
    τ SmolLM2 measured in this run and at swift-tiny's, each at most the cap."""
    env = check.record["results"].get("env") or {}
    bandwidth = env.get("copy_bandwidth_gb_s")
    figures: dict[str, Any] = {}
    for shape in SHAPES:
        report = shape.report(check)
        if report is None:
            continue
        cap = trie_cap(report["meta"]["tree"])
        taus = [Tau("cap", float(cap), f"the trie's cap: depth + 1 = {cap}")]
        for label, stage in (("smollm2", SMOLLM2_TAU_STAGE), ("swift_tiny", TINY_TAU_STAGE)):
            measured = check.record["results"].get(stage)
            if measured and measured.get("tau"):
                source = (
                    f"{stage} in this run (tree {measured['tree']}, {measured['ngram_topk']} n-gram branches)"
                )
                taus.append(capped(label, measured["tau"], source, cap))
        result = remodel(report, taus, steady=True)
        if bandwidth:
            floors = ar_floor_ms(
                check.sizes.shape_model,
                "bfloat16" if check.cuda else "float32",
                [row["prompt_length"] for row in result["per_context"]],
                bandwidth * 1e9,
            )
            for row in result["per_context"]:
                row["ar_floor_ms"] = floors[row["prompt_length"]]
                row["ar_over_floor"] = round(row["ar_ms_per_token"] / row["ar_floor_ms"], 3)
            result["copy_bandwidth_gb_s"] = bandwidth
        result["model"] = check.sizes.shape_model
        result["source"] = f"results/{shape.name}/group-*/bench.json"
        figures[shape.name] = result
    return figures


def model_stage(check: Check) -> dict[str, Any]:
    check.modeled = True
    figures = modeled_figures(check)
    if not figures:
        return {"status": "skipped", "reason": "no 8B iteration times: 8b-k4 did not finish"}
    labels = {tau["label"] for result in figures.values() for tau in result["taus"]}
    entry: dict[str, Any] = {"status": "ok"}
    if "smollm2" not in labels:
        entry["note"] = (
            "no SmolLM2 τ in this run: modeled at the trie's cap (and swift-tiny's τ where measured)"
        )
    return entry


# ---------------------------------------------------------------- stages: the rest


def env_plan(check: Check) -> Commands:
    return [
        [
            check.python,
            "-m",
            "tools.gpu_env",
            "--device",
            check.sizes.device,
            "--out",
            str(check.work / "env.json"),
        ]
    ]


def env_summary(check: Check) -> dict[str, Any] | None:
    return read_json(check.work / "env.json")


def phases_plan(check: Check) -> Commands:
    sizes = check.sizes
    model = "smollm2-135m" if check.cuda else "swift-tiny"  # the shape only: random weights
    return [
        [
            check.python,
            "-m",
            "tools.gpu_iteration_profile",
            "--model",
            model,
            "--device",
            sizes.device,
            "--dtype",
            "bfloat16" if check.cuda else "float32",
            "--contexts",
            sizes.phase_context,
            "--tree",
            "3,3,3",
            "--ngram-topk",
            "4",
            "--iterations",
            str(sizes.phase_iterations),
            "--kernels",
            "15",
            "--out",
            str(check.work / "smollm2-phases"),
        ]
    ]


def phases_summary(check: Check) -> dict[str, Any] | None:
    folder = check.work / "smollm2-phases"
    found = sorted(folder.glob("*.json")) if folder.is_dir() else []
    return read_json(found[0]) if found else None


def adaptation_plan(check: Check) -> Commands | Skip:
    """SmolLM2 on the device loop (CUDA's default, its iterations graph-captured) with its committed
    layers and with layers adapting as it commits (`bench --compare-adaptation`; on CUDA the step runs
    on a side stream): the iteration's time with and without adaptation, by turns in one process. A
    dry run times swift-tiny."""
    sizes = check.sizes
    smollm2 = check.cuda  # a dry run times swift-tiny
    model, prefix = ("smollm2-135m", sizes.smollm2_prefix) if smollm2 else ("swift-tiny", sizes.tiny_prefix)
    flags = ["--device-loop", "--compare-adaptation", "--draft-source", "verify"]
    run = EndToEnd(model, "paper", "bfloat16", tree="1,1,1", ngram_topk=0)
    return run.bench(check, prefix, sizes.adapt_gen, check.work / "adapt-cost", flags)


def adaptation_summary(check: Check) -> dict[str, Any] | None:
    report = read_json(check.work / "adapt-cost" / "bench.json")
    if report is None:
        return None
    rows = []
    for row in report["rows"]:
        static, adapted = row["tokenswift_decode_ms_per_iteration"], row["adapted_decode_ms_per_iteration"]
        rows.append(
            {
                "prefix_len": row["prefix_len"],
                "gen_len": row["gen_len"],
                "static_ms_per_iteration": static,
                "adapted_ms_per_iteration": adapted,
                "iteration_cost": round(adapted / static - 1, 4) if static else None,
                "adapted_vs_static": row["adapted_vs_static"],
                "draft_updates": row["adapted_draft_updates"],
                "alpha_by_depth": row["alpha_by_depth"],
                "adapted_alpha_by_depth": row["adapted_alpha_by_depth"],
                "tokens_equal_ar": row["tokens_equal_ar"] and row["adapted_tokens_equal_ar"],
            }
        )
    return {"command": report["meta"].get("command"), "adaptation": rows}


def tests_plan(check: Check) -> Commands:
    args = [check.python, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *TESTS]
    if not check.cuda:  # a dry run: the list resolves and collects
        return [[*args, "-q", "--collect-only"]]
    if importlib.util.find_spec("xdist") is not None:  # 16 cores, one GPU: files spread over 4 workers
        args += ["-n", "4", "--dist", "loadfile"]
    return [[*args, "-v", "--durations", "15"]]  # -v: each result logged as it comes, in case of a cut


def tests_summary(check: Check) -> dict[str, Any] | None:
    log = check.work / "tests.log"
    if not log.is_file():
        return None
    lines = log.read_text(errors="replace").splitlines()
    outcome = [
        line
        for line in lines
        if " in " in line and any(w in line for w in ("passed", "failed", "error", "collected"))
    ]
    return {"result": outcome[-1].strip("= ") if outcome else last_line(log)}


def training_plan(check: Check) -> Commands:
    """The draft-layer pipeline on the GPU (docs/training.md), small: SmolLM2 writes 64 continuations
    (batched), trains root-conditioned layers from zero for 60 bf16 steps, and `eval-heads` predicts and
    measures their acceptance. A dry run does the same with swift-tiny on the CPU, smaller."""
    work = check.work / "training"
    books = ["--prompts", "data/corpus/moby_dick.txt.gz", "--prompts", "data/corpus/iliad.txt.gz"]
    if check.cuda:
        model, dtype, count, new, steps, seq = (
            ["--model", "smollm2-135m"],
            "bfloat16",
            "64",
            "256",
            "60",
            "256",
        )
    else:
        model, dtype, count, new, steps, seq = ["--model", "swift-tiny"], "float32", "8", "64", "4", "32"
    directory = "models/smollm2-135m" if check.cuda else "models/swift-tiny"
    device = ["--device", check.sizes.device]
    data, held_out = str(work / "data.jsonl"), str(work / "held-out.jsonl")
    write = ["--sequences", count, "--new-tokens", new, "--prompt-tokens", "64", "--max-batch", "32", *device]
    return [
        check.cli("train-data", *model, *books, *write, "--method", "ar", "--output", data),
        check.cli(
            "train-data", *model, *books, *write, "--seed", "1000", "--method", "ar", "--output", held_out
        ),
        check.cli(
            "train-heads",
            "--model-dir",
            directory,
            "--data",
            data,
            "--eval-data",
            held_out,
            "--out",
            str(work / "heads"),
            "--steps",
            steps,
            "--seq-len",
            seq,
            "--batch",
            "8",
            "--grad-accum",
            "1",
            "--warmup-steps",
            "5",
            "--eval-every",
            "20",
            "--checkpoint-every",
            "20",
            "--root-width",
            "512",
            "--draft-vocab",
            "8192",
            "--loss",
            "sampled",
            "--dtype",
            dtype,
            *device,
        ),
        check.cli(
            "eval-heads",
            *model,
            "--heads",
            str(work / "heads" / "heads.safetensors"),
            "--data",
            held_out,
            "--sequences",
            "4",
            "--seq-len",
            seq,
            "--measure-prompts",
            "1",
            "--measure-tokens",
            "128",
            *device,
            "--out",
            str(work / "eval.json"),
        ),
    ]


def training_summary(check: Check) -> dict[str, Any] | None:
    report = read_json(check.work / "training" / "eval.json")
    trained = read_json(check.work / "training" / "heads" / "train_heads.json")
    if report is None or trained is None:
        return None
    return {
        "steps": trained["steps"],
        "final_loss": trained["final_loss"],
        "predicted": report["predicted"],
        "measured": report.get("measured"),
    }


BATCHING_RUNS = {  # run name: the kernel setting it runs the batch with
    "one-pass": "batched_forward=on",  # every product over all requests' rows (CUDA's default)
    "per-request": "batched_forward=off",  # one forward per request
    "invariant": "batch_invariant=products",  # one pass, products and norms row-wise
}


def batching_plan(check: Check) -> Commands:
    """A few users at once (`demo --users`): their requests one at a time (the device loop, CUDA's
    default), then batched, with the batch as one pass of the layers, as one forward per request, and as
    one pass with row-wise products (whose tokens must be the runs' alone). A dry run does it with
    swift-tiny in float64 on the CPU (no compiled decoder there: the pass runs)."""
    model, dtype, users, tokens = (
        ("smollm2-135m", "bfloat16", "8", "256") if check.cuda else ("swift-tiny", "float64", "3", "16")
    )
    demo = [
        "demo",
        "--model",
        model,
        "--dtype",
        dtype,
        "--device",
        check.sizes.device,
        "--max-new-tokens",
        "32",
    ]
    demo += ["--no-edit", "--users", users, "--user-tokens", tokens, "--seed", "1"]
    return [
        check.cli(*demo, "--kernel", kernel, "--out", str(check.work / "batching" / name))
        for name, kernel in BATCHING_RUNS.items()
    ]


def batching_summary(check: Check) -> dict[str, Any] | None:
    found = {}
    for name in BATCHING_RUNS:
        report = read_json(check.work / "batching" / name / "run.json")
        if report is not None:
            found[name] = next(row for row in report["rows"] if row["job"] == "users")
    return {"batching": found} if found else None


def tp_plan(check: Check) -> Commands | Skip:
    """swift-tiny greedy on one GPU and on two (NCCL), compared (tools/tp_check.py)."""
    if not check.cuda:
        return Skip("a dry run: tests/cli/test_tp_generate.py runs --tp 2 on the CPU (gloo)")
    import torch

    if torch.cuda.device_count() < 2:
        return Skip(f"--tp 2 needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    return [[check.python, "-m", "tools.tp_check", str(check.work / "tp.json")]]


def stages(sizes: Sizes) -> list[Stage]:
    """Every stage, most valuable first (the acceptance figures, then the tests, then variants)."""
    smollm2, tiny = "smollm2-135m", "swift-tiny"
    return [
        Stage("carry", "gather the carried SmolLM2 parts into the stash", 60, 0, inline=gather_parts),
        Stage(
            "env",
            "GPU, driver, torch, CUDA, copy bandwidth; our CUDA kernels built",
            240,
            30,
            plan=env_plan,
            summarize=env_summary,
        ),
        Stage(
            "smollm2-import",
            f"join the SmolLM2 parts, import the GGUF into {SMOLLM2_DIR}",
            150,
            40,
            plan=import_plan,
        ),
        EndToEnd(smollm2, "paper", "bfloat16").stage(200, 60),
        SHAPES[0].stage(200, 90),
        Stage(
            "model",
            "the ~100K-token generation modeled at the trie's cap and the measured τ",
            60,
            0,
            inline=model_stage,
        ),
        Stage(
            "batching",
            "8 users of SmolLM2 one at a time and batched: one pass of the layers, a forward each, row-wise",
            150,
            60,
            plan=batching_plan,
            summarize=batching_summary,
        ),
        Stage(
            "adapt-cost",
            "SmolLM2's device-loop iteration with and without draft adaptation (a side stream on CUDA)",
            150,
            60,
            plan=adaptation_plan,
            summarize=adaptation_summary,
        ),
        EndToEnd(tiny, "paper", "bfloat16").stage(100, 30),
        Stage(
            "smollm2-phases",
            "SmolLM2's shape: one device-loop iteration's time phase by phase",
            90,
            30,
            plan=phases_plan,
            summarize=phases_summary,
        ),
        Stage("tests", "the GPU tests", 200, 60, plan=tests_plan, summarize=tests_summary),
        EndToEnd(smollm2, "greedy", "bfloat16").stage(150, 50),
        EndToEnd(smollm2, "paper", "float32").stage(150, 50),
        EndToEnd(tiny, "greedy", "bfloat16").stage(90, 30),
        SHAPES[1].stage(150, 60),
        Stage(
            "training",
            "the draft-layer pipeline in bf16: train-data, 60 train-heads steps, eval-heads (SmolLM2)",
            240,
            90,
            plan=training_plan,
            summarize=training_summary,
        ),
        Stage(
            "tp",
            "swift-tiny on one GPU and on two tensor-parallel ranks (NCCL), compared",
            120,
            40,
            plan=tp_plan,
            summarize=lambda check: read_json(check.work / "tp.json"),
        ),
    ]


# ---------------------------------------------------------------- summary.md


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if cell is None else str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def summary_markdown(record: dict[str, Any]) -> str:
    """run.json as tables: the machine, every stage, the end-to-end runs, the 8B times and the modeling."""
    machine_info = record.get("machine", {})
    device = machine_info.get("gpu") or machine_info.get("cuda_device") or record.get("device")
    parts = [
        f"# Prepared check: {device}\n\n",
        f"`{record['command']}` at {record['started']} (commit {record['git'].get('commit')}); driver "
        f"{machine_info.get('driver', '-')}, torch {machine_info.get('torch')}, CUDA "
        f"{machine_info.get('torch_cuda')}, copy bandwidth "
        f"{machine_info.get('copy_bandwidth_gb_s', '-')} GB/s; "
        f"{record['elapsed_s']}s of the {record['budget_s']}s budget"
        + ("" if record.get("finished") else " (unfinished)")
        + ".\n\n",
        table(
            ["stage", "status", "seconds", "why not run / note"],
            [
                [s["name"], s["status"], s.get("seconds"), s.get("reason") or s.get("note")]
                for s in record["stages"]
            ],
        ),
    ]
    runs = [(name, result) for name, result in record["results"].items() if "tau" in result]
    if runs:
        parts.append("\n## Measured end to end (AR and TokenSwift taking turns)\n\n")
        parts.append(
            table(
                [
                    "stage",
                    "prompt",
                    "new tokens",
                    "AR tok/s",
                    "TokenSwift tok/s",
                    "speedup",
                    "τ",
                    "α by depth",
                    "tokens equal AR's",
                ],
                [
                    [
                        name,
                        row["prefix_len"],
                        row["gen_len"],
                        row["ar_tokens_per_s"],
                        row["tokenswift_tokens_per_s"],
                        row["speedup"],
                        row["tokens_per_iteration"],
                        row["alpha_by_depth"],
                        row["tokens_equal_ar"],
                    ]
                    for name, result in runs
                    for row in result["rows"]
                ],
            )
        )
    adaptation = [(name, r) for name, r in record["results"].items() if "adaptation" in r]
    if adaptation:
        parts.append("\n## Draft adaptation: the device loop's iteration with and without it\n\n")
        parts.append(
            table(
                [
                    "stage",
                    "prompt",
                    "new tokens",
                    "static ms / iteration",
                    "adapted ms / iteration",
                    "iteration cost",
                    "adapted vs static speed",
                    "adaptation steps",
                    "α by depth, static / adapted",
                    "tokens equal AR's",
                ],
                [
                    [
                        name,
                        row["prefix_len"],
                        row["gen_len"],
                        row["static_ms_per_iteration"],
                        row["adapted_ms_per_iteration"],
                        row["iteration_cost"],
                        row["adapted_vs_static"],
                        row["draft_updates"],
                        f"{row['alpha_by_depth']} / {row['adapted_alpha_by_depth']}",
                        row["tokens_equal_ar"],
                    ]
                    for name, result in adaptation
                    for row in result["adaptation"]
                ],
            )
        )
    batching = record["results"].get("batching", {}).get("batching")
    if batching:
        parts.append("\n## Users at once: one at a time and batched\n\n")
        parts.append(
            table(
                [
                    "batch runs",
                    "users",
                    "tokens each",
                    "one at a time tok/s",
                    "batched tok/s",
                    "speedup",
                    "same tokens",
                ],
                [
                    [
                        f"{name} ({BATCHING_RUNS[name]})",
                        row["users"],
                        row["tokens_per_user"],
                        row["one_at_a_time_tokens_per_s"],
                        row["batched_tokens_per_s"],
                        row["speedup"],
                        row["same_tokens_as_alone"],
                    ]
                    for name, row in batching.items()
                ],
            )
        )
    for name, result in (record.get("modeled") or {}).items():
        parts.append(
            f"\n## {result['model']} shape, random weights: measured times ({name}, tree {result['tree']}, "
            f"{result['ngram_topk']} n-gram branches, cap {result['trie_cap']} tokens per iteration)\n\n"
        )
        parts.append(
            table(
                ["prompt tokens", "AR ms/token", "AR floor ms", "AR / floor", "iteration ms", "in AR steps"],
                [
                    [
                        row["prompt_length"],
                        row["ar_ms_per_token"],
                        row.get("ar_floor_ms"),
                        row.get("ar_over_floor"),
                        row["iteration_ms"],
                        row["iteration_over_ar_step"],
                    ]
                    for row in result["per_context"]
                ],
            )
        )
        parts.append("\nModeled from those times (τ x AR ms / iteration ms):\n\n")
        parts.append(
            table(
                [
                    "τ",
                    "from",
                    *[f"{row['prompt_length']}" for row in result["per_context"]],
                    "long generation",
                ],
                [
                    [
                        tau["tau"],
                        tau["label"]
                        + (f" (measured {tau['measured']}, capped)" if "measured" in tau else ""),
                        *[f"{row['speedup_' + tau['label']]}x" for row in result["per_context"]],
                        _long_run_text(result["long_runs"][tau["label"]]),
                    ]
                    for tau in result["taus"]
                ],
            )
        )
    return "".join(parts)


def _long_run_text(long_runs: list[dict[str, Any] | None]) -> str:
    last = long_runs[-1] if long_runs else None
    if not last:
        return ""
    return f"{last['tokens']} tokens from {last['from_context']}: {last['modeled_speedup']}x"


# ---------------------------------------------------------------- main


def run_check(check: Check, chosen: list[Stage]) -> dict[str, Any]:
    """Run the chosen stages in order, saving after each; returns the record (also OUT/run.json)."""
    check.out.mkdir(parents=True, exist_ok=True)
    check.work.mkdir(parents=True, exist_ok=True)
    for name in OUT_FILES:
        (check.out / name).unlink(missing_ok=True)
    check.record = {
        "command": check.command,
        "started": utc_now(),
        "finished": None,
        "device": check.sizes.device,
        "dry_run": not check.cuda,
        "budget_s": check.sizes.budget_s,
        "sizes": {key: value for key, value in vars(check.sizes).items()},
        "git": git_commit(check.given_commit),
        "machine": machine(),
        "stages": [
            {"name": stage.name, "what": stage.what, "status": "pending", "limit_s": stage.limit_s}
            for stage in chosen
        ],
        "results": {},
    }
    check.save()
    for stage in chosen:
        check.run_stage(stage)
    check.record["finished"] = utc_now()
    check.save()
    return check.record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for run.json, summary.md, run.log, results.tar.gz")
    parser.add_argument(
        "--device", default="cuda", help="cuda: the prepared run; cpu: a dry run at tiny sizes"
    )
    parser.add_argument("--stages", default=None, help="comma-separated stage names (default: all, in order)")
    parser.add_argument("--budget-s", type=int, default=None, help="seconds for all stages [500 on CUDA]")
    parser.add_argument("--work", type=Path, default=None, help="stage outputs [runs/gpu-check/<time>]")
    parser.add_argument(
        "--stash", type=Path, default=DEFAULT_STASH, help=f"parts kept here [{DEFAULT_STASH}]"
    )
    parser.add_argument("--carry", type=Path, default=REPOSITORY / ".carry", help="carried parts [.carry]")
    parser.add_argument("--git-commit", default=None, help="the commit to record where the copy has no .git")
    args = parser.parse_args(argv)
    sizes = GPU if args.device.startswith("cuda") else DRY
    sizes = replace(sizes, device=args.device)
    if args.budget_s is not None:
        if args.budget_s < 1:
            parser.error(f"--budget-s must be at least 1, got {args.budget_s}")
        sizes = replace(sizes, budget_s=args.budget_s)
    every = stages(sizes)
    chosen = every
    if args.stages:
        names = [name.strip() for name in args.stages.split(",") if name.strip()]
        known = {stage.name for stage in every}
        unknown = [name for name in names if name not in known]
        if unknown:
            parser.error(
                f"unknown stage {', '.join(unknown)}: choose from {', '.join(s.name for s in every)}"
            )
        chosen = [stage for stage in every if stage.name in names]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work = (args.work or REPOSITORY / "runs" / "gpu-check" / stamp).resolve()
    command = gpu_check_command() or shlex.join(
        ["python", "-m", "tools.gpu_check", *(argv if argv is not None else sys.argv[1:])]
    )
    check = Check(
        args.out.resolve(),
        work,
        sizes,
        args.stash.resolve(),
        command,
        echo=lambda line: print(line, flush=True),
        carry=args.carry.resolve(),
        given_commit=args.git_commit,
    )

    def interrupted(signum: int, _frame: object) -> None:
        check.stop_child()
        for entry in check.record.get("stages", []):
            if entry["status"] == "running":
                entry.update(status="interrupted", reason=f"the run was stopped (signal {signum})")
        check.save()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    record = run_check(check, chosen)
    print(f"wrote {', '.join(str(check.out / name) for name in OUT_FILES)}")
    failed = [entry["name"] for entry in record["stages"] if entry["status"] in ("failed", "timeout")]
    if failed:
        print(f"stages that failed or ran out of time: {', '.join(failed)} (run.json says why)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The prepared GPU check (tools/gpu_check.py): its dry run on this CPU goes through every
stage and writes the same files; a run cut off keeps what it measured; carried parts are gathered and
a missing one is named; modeled figures never assume more tokens per iteration than the trie commits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tokenswift_trt.builder.pack import split_directory
from tools import gpu_check
from tools.gpu_check import (
    DRY,
    OUT_FILES,
    Check,
    Skip,
    Stage,
    gather_parts,
    import_plan,
    run_check,
)

REPOSITORY = Path(__file__).resolve().parents[2]


def make_check(tmp_path: Path, budget_s: int = 60, **kwargs) -> Check:
    from dataclasses import replace

    return Check(
        out=tmp_path / "out",
        work=tmp_path / "work",
        sizes=replace(DRY, budget_s=budget_s, min_scale=1.0),
        stash=tmp_path / "stash" / "smollm2",
        command="test",
        echo=lambda line: None,
        carry=tmp_path / "carry",
        **kwargs,
    )


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_stage_past_its_limit_is_stopped_and_the_run_keeps_what_came_before(tmp_path):
    chosen = [
        Stage("first", "prints", 30, 0, plan=lambda check: [python("print('measured 1.5')")]),
        Stage(
            "slow", "sleeps past its limit", 1, 0, plan=lambda check: [python("import time; time.sleep(60)")]
        ),
        Stage(
            "fails",
            "exits 3",
            30,
            0,
            plan=lambda check: [python("import sys; print('bad input'); sys.exit(3)")],
        ),
        Stage("missing", "needs a model", 30, 0, plan=lambda check: Skip("the model is not here")),
        Stage("late", "needs more time than is left", 30, 100, plan=lambda check: [python("pass")]),
    ]
    record = run_check(make_check(tmp_path), chosen)
    by_name = {entry["name"]: entry for entry in record["stages"]}
    assert by_name["first"]["status"] == "ok"
    assert by_name["slow"]["status"] == "timeout" and by_name["slow"]["seconds"] < 15
    assert by_name["fails"]["status"] == "failed" and by_name["fails"]["reason"] == "exit code 3: bad input"
    assert by_name["missing"] == {
        **by_name["missing"],
        "status": "skipped",
        "reason": "the model is not here",
    }
    assert by_name["late"]["status"] == "skipped" and by_name["late"]["reason"].startswith("out of time")
    written = json.loads((tmp_path / "out" / "run.json").read_text())
    assert [entry["status"] for entry in written["stages"]] == [
        "ok",
        "timeout",
        "failed",
        "skipped",
        "skipped",
    ]
    assert written["finished"] and written["git"]["commit"]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted(OUT_FILES)
    assert "measured 1.5" in (tmp_path / "out" / "run.log").read_text()


def test_carried_parts_are_gathered_into_the_stash_and_a_missing_one_is_named(tmp_path, monkeypatch):
    source = tmp_path / "source"
    source.mkdir()
    (source / "model.whl").write_bytes(os.urandom(3000))
    split_directory(source, tmp_path / "parts", 1024)  # 3 parts
    for index in (1, 2):  # two of the three calls' folders arrived
        folder = tmp_path / "carry" / f"smollm2-{index}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_bytes((tmp_path / "parts" / "manifest.json").read_bytes())
        name = f"part-{index - 1:05d}.bin"
        (folder / name).write_bytes((tmp_path / "parts" / name).read_bytes())
    check = make_check(tmp_path)
    check.record = {"stages": [{"name": "carry"}]}
    result = gather_parts(check)
    assert result["status"] == "ok" and result["missing"] == ["part-00002.bin"] and result["parts"] == 3
    assert "1 of 3 parts missing (part-00002.bin)" in result["note"]
    assert sorted(path.name for path in check.stash.iterdir()) == [
        "manifest.json",
        "part-00000.bin",
        "part-00001.bin",
    ]
    check.record["stages"][0].update(result)
    monkeypatch.setattr(gpu_check, "smollm2_ready", lambda: False)
    plan = import_plan(check)
    assert isinstance(plan, Skip) and not plan.ok and "part-00002.bin" in plan.reason

    # the last call brings the third part: the stash (kept on the machine) completes, the import runs
    folder = tmp_path / "carry" / "smollm2-3"
    folder.mkdir()
    (folder / "part-00002.bin").write_bytes((tmp_path / "parts" / "part-00002.bin").read_bytes())
    for old in ("smollm2-1", "smollm2-2"):
        for path in (tmp_path / "carry" / old).iterdir():
            path.unlink()
    result = gather_parts(check)
    assert result["missing"] == [] and "note" not in result
    check.record["stages"][0].update(result)
    (command,) = import_plan(check)
    assert "pack join" in command[-1] and "tokenswift_trt.builder.smollm2" in command[-1]


def test_nothing_carried_is_a_skip_that_says_how_to_carry(tmp_path):
    check = make_check(tmp_path)
    result = gather_parts(check)
    assert result["status"] == "skipped" and "scripts/prepare_carry.sh" in result["reason"]


@pytest.mark.slow
def test_the_dry_run_goes_through_every_stage_and_models_at_most_the_trie_cap(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    result = subprocess.run(
        [
            "bash",
            "scripts/gpu_checks.sh",
            str(out),
            "prepared",
            "--device",
            "cpu",
            "--work",
            str(work),
            "--stash",
            str(tmp_path / "stash"),
            "--carry",
            str(tmp_path / "carry"),
        ],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == sorted(OUT_FILES)
    record = json.loads((out / "run.json").read_text())
    assert (
        record["dry_run"]
        and record["finished"]
        and record["command"].startswith("bash scripts/gpu_checks.sh")
    )
    assert record["machine"]["torch"] and record["machine"]["copy_bandwidth_gb_s"] > 0
    names = [stage.name for stage in gpu_check.stages(DRY)]
    assert [entry["name"] for entry in record["stages"]] == names
    by_name = {entry["name"]: entry for entry in record["stages"]}
    assert by_name["carry"]["status"] == "skipped" and "prepare_carry" in by_name["carry"]["reason"]
    smollm2 = (REPOSITORY / "models/smollm2-135m/gguf_source.json").is_file()
    for entry in record["stages"]:
        assert entry["status"] in ("ok", "skipped"), entry
        assert isinstance(entry["seconds"], float)
        if entry["status"] == "skipped":
            assert entry["reason"]
        if entry["name"].startswith("smollm2-") and entry["name"] != "smollm2-phases":
            # with the model imported every SmolLM2 stage runs (the import: "already imported");
            # without it and nothing carried, each is skipped saying why
            assert (entry["status"] == "ok") == smollm2, entry
    for name in ("swift-tiny-paper-bf16", "swift-tiny-greedy-bf16") + (
        ("smollm2-paper-bf16",) if smollm2 else ()
    ):
        rows = record["results"][name]["rows"]
        assert [row["gen_len"] for row in rows] == [
            int(n) for n in (DRY.smollm2_gen if "smollm2" in name else DRY.tiny_gen).split(",")
        ]
        assert all(row["tokens_per_iteration"] >= 1 and row["alpha_by_depth"] for row in rows)
    # the adaptation cost: the device loop's iteration with and without adapting layers, same tokens
    (adapted,) = record["results"]["adapt-cost"]["adaptation"]
    assert adapted["gen_len"] == int(DRY.adapt_gen) and adapted["tokens_equal_ar"]
    assert adapted["draft_updates"] >= 1  # the adapted run did adapt (a step every 16 positions)
    assert adapted["static_ms_per_iteration"] > 0 and adapted["adapted_ms_per_iteration"] > 0
    assert "--compare-adaptation" in record["results"]["adapt-cost"]["command"]
    # users at once: batched as one pass of the layers, a forward each and row-wise, each the runs alone
    batching = record["results"]["batching"]["batching"]
    assert set(batching) == set(gpu_check.BATCHING_RUNS)
    assert all(row["users"] == 3 and row["same_tokens_as_alone"] for row in batching.values())
    # the draft-layer pipeline: the model's text, 4 training steps, the layers predicted and measured
    training = record["results"]["training"]
    assert training["steps"] == 4 and training["predicted"]["positions"] > 0
    assert training["measured"]["new_tokens"] == 128 and training["measured"]["speedup"] > 0
    # the modeling: every 8B-shape run, τ at the cap and as measured (never above the cap)
    assert set(record["modeled"]) == {"8b-k4", "8b-k20"}
    for modeled in record["modeled"].values():
        cap = modeled["trie_cap"]
        labels = {tau["label"]: tau["tau"] for tau in modeled["taus"]}
        assert labels["cap"] == cap and all(tau <= cap for tau in labels.values())
        assert ("smollm2" in labels) == smollm2 and "swift_tiny" in labels
        for row in modeled["per_context"]:
            assert row["ar_floor_ms"] > 0 and row["ar_over_floor"] > 0
            for label, tau in labels.items():
                assert row[f"speedup_{label}"] <= round(cap * row["ar_ms_per_token"] / row["iteration_ms"], 3)
                assert row[f"speedup_{label}"] == round(tau * row["ar_ms_per_token"] / row["iteration_ms"], 3)
    assert len(record["modeled"]["8b-k4"]["per_context"]) == 4
    summary = (out / "summary.md").read_text()
    assert "Modeled from those times" in summary and "| tests | ok |" in summary
    adaptation_table = summary.split("Draft adaptation: the device loop's iteration")[1]
    assert f"| adapt-cost | {DRY.tiny_prefix} | {DRY.adapt_gen} | {adapted['static_ms_per_iteration']} |" in (
        adaptation_table
    )
    with tarfile.open(out / "results.tar.gz") as archive:
        members = set(archive.getnames())
    assert {"results/8b-k4/group-2/bench.json", "results/env.json", "results/tests.log"} <= members


def test_a_copy_without_git_records_the_commit_it_was_given(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "REPOSITORY", tmp_path)  # the device machine's copy has no .git
    assert gpu_check.git_commit("abc123") == {"commit": "abc123", "from": "--git-commit"}
    assert "--git-commit" in gpu_check.git_commit()["commit"]


def test_every_gpu_test_the_check_runs_exists():
    """A renamed or moved test would make the GPU check's test stage fail on the machine it is for."""
    root = Path(__file__).resolve().parents[2]
    for entry in gpu_check.TESTS:
        path, _, name = entry.partition("::")
        assert (root / path).is_file(), entry
        assert not name or f"def {name}(" in (root / path).read_text(), entry

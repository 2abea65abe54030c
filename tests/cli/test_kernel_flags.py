"""`--kernel NAME=VALUE` on the command line: recorded by `build` in the manifest and by `generate` in
journals; `--resume` loads a journal's kernel settings and refuses a changed output-deciding one."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.cli import main
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.engine_dir import read_manifest


def _run(*args: str):
    return CliRunner().invoke(main, [str(arg) for arg in args])


def test_cli_kernel_flags_reach_the_manifest_and_journals_and_resume_refuses_a_change(tmp_path):
    checkpoint = write_random_model(tmp_path / "checkpoint", seed=3)
    built = _run("build", "--model", checkpoint, "--out", tmp_path / "engine", "--kernel", "cpu_kernel=off")
    assert built.exit_code == 0, built.output
    assert read_manifest(tmp_path / "engine").kernels["cpu_kernel"] == "off"
    journal = tmp_path / "run.journal"
    common = ["--prompt", "Once", "--max-new-tokens", "24", "--seed", "4", "--ignore-eos", "--json"]
    first = _run("generate", "--engine", tmp_path / "engine", *common, "--journal", journal)
    assert first.exit_code == 0, first.output
    header = json.loads(journal.read_text().splitlines()[0].rsplit("\t", 1)[0])
    assert header["model"]["kernels"] == KernelConfig(cpu_kernel="off").to_dict()
    # --resume loads the journal's kernel settings; a changed output-deciding one is refused in one line
    refused = _run("generate", "--resume", journal, "--kernel", "cpu_kernel=on")
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        f"tokenswift-trt: error: {journal} was written with other output-deciding kernel settings than "
        "this engine's (cpu_kernel=on): resume it with --kernel cpu_kernel=off"
    ]
    speed_only = _run("generate", "--resume", journal, "--kernel", "huge_pages=off", "--json")
    assert speed_only.exit_code == 0, speed_only.output
    assert (
        json.loads(speed_only.stdout.splitlines()[-1])["token_ids"]
        == json.loads(first.stdout.splitlines()[-1])["token_ids"]
    )
    bad = _run("generate", "--engine", tmp_path / "engine", *common, "--kernel", "cpu_kernel=fast")
    assert bad.exit_code == 2 and "cpu_kernel is one of auto, on, off, got 'fast'" in bad.stderr
    assert "Traceback" not in bad.output
    helped = _run("generate", "--help")
    assert "--kernel NAME=VALUE" in helped.output and "tree_row_tiles" in helped.output


def test_the_cli_loads_a_model_dir_with_its_kernel_flags(tmp_path):
    checkpoint = write_random_model(tmp_path / "checkpoint", seed=5)
    args = ["--model-dir", checkpoint, "--prompt", "Hi", "--max-new-tokens", "8", "--temperature", "0"]
    runs = [_run("generate", *args, "--json", "--kernel", f"cpu_kernel={mode}") for mode in ("off", "auto")]
    assert all(run.exit_code == 0 for run in runs), [run.output for run in runs]
    tokens = [json.loads(run.stdout.splitlines()[-1])["token_ids"] for run in runs]
    assert tokens[0] == tokens[1]

"""docs/cli.md is every command's `--help` as the installed commands print it, and is up to date."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tokenswift_trt.builder.presets import REPOSITORY
from tokenswift_trt.cli import main
from tokenswift_trt.cli.reference import PROGRAM, REGENERATE, WIDTH, render, walk

DOCS = REPOSITORY / "docs/cli.md"


def test_docs_cli_md_is_up_to_date():
    if not DOCS.is_file() or DOCS.read_text(encoding="utf-8") != render(main):
        pytest.fail(f"docs/cli.md is out of date with the commands: run `{REGENERATE}`", pytrace=False)


def test_the_reference_holds_every_commands_help_as_the_command_prints_it():
    reference = render(main)
    paths = [words for words, _ in walk(main)]
    assert ("pack", "split") in paths and ("generate",) in paths and () in paths  # groups are walked
    assert len(paths) == len(set(paths)) >= 18
    for words in paths:
        result = CliRunner().invoke(
            main, [*words, "--help"], prog_name=PROGRAM, terminal_width=WIDTH, max_content_width=WIDTH
        )
        assert result.exit_code == 0, result.output
        block = f"## `{' '.join((PROGRAM, *words))}`\n\n```text\n{result.stdout}```\n"
        assert block in reference, words
    assert "\x1b" not in reference  # no colours
    help_lines = [
        line for block in reference.split("```text\n")[1:] for line in block.split("```")[0].splitlines()
    ]
    assert max(map(len, help_lines)) <= WIDTH  # wrapped at the fixed width, whatever the terminal


def test_the_module_prints_the_reference():
    printed = subprocess.run(
        [sys.executable, "-m", "tokenswift_trt.cli.reference"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "40"},  # a narrow terminal changes nothing
    )
    assert printed.returncode == 0 and printed.stdout == render(main), printed.stderr

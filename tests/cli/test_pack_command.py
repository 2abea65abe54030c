"""`tokenswift-trt pack split` / `pack join`: parts and back through the command, one-line errors."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from tokenswift_trt.builder.presets import REPOSITORY
from tokenswift_trt.cli import main

SWIFT_TINY = REPOSITORY / "models/swift-tiny"


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_split_and_join_through_the_command(tmp_path):
    parts, joined = tmp_path / "parts", tmp_path / "joined"
    split = _run("pack", "split", str(SWIFT_TINY), "--part-size", "2M", "--out", str(parts))
    assert split.exit_code == 0, split.output
    assert "parts of at most 2,097,152 bytes" in split.stdout
    assert max(path.stat().st_size for path in parts.glob("part-*.bin")) == 2 << 20
    join = _run("pack", "join", str(parts), "--out", str(joined))
    assert join.exit_code == 0, join.output and "every sha256 checked" in join.stdout
    for path in SWIFT_TINY.iterdir():
        assert (joined / path.name).read_bytes() == path.read_bytes()

    (parts / "part-00004.bin").write_bytes(b"x" * (2 << 20))  # same size, other bytes
    corrupt = _run("pack", "join", str(parts), "--out", str(tmp_path / "again"))
    assert corrupt.exit_code == 2
    assert corrupt.stderr.startswith("tokenswift-trt: error: part part-00004.bin is corrupt")
    assert corrupt.stderr.count("\n") == 1 and not (tmp_path / "again").exists()

    (parts / "part-00004.bin").unlink()
    missing = _run("pack", "join", str(parts), "--out", str(tmp_path / "again"))
    assert missing.exit_code == 2 and missing.stderr.count("\n") == 1
    assert "part part-00004.bin is missing" in missing.stderr


def test_a_bad_part_size_is_refused_in_one_line_by_the_installed_command(tmp_path):
    script = [sys.executable, "-m", "tokenswift_trt.cli"]
    for size in ("40X", "0", "1.5G"):
        result = subprocess.run(
            [*script, "pack", "split", str(SWIFT_TINY), "--part-size", size, "--out", str(tmp_path / "p")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert f"bad part size '{size}'" in result.stderr and "e.g. 40M or 1G" in result.stderr
    assert not (tmp_path / "p").exists()

"""The package holds the product: the benchmark commands users run stay small beside the decoder and the
model (measurement of our own runs lives in tools/)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenswift_trt"


def _lines(paths: list[Path]) -> int:
    return sum(len(path.read_text().splitlines()) for path in paths)


def test_measurement_code_stays_a_small_part_of_the_package():
    bench = _lines(sorted((PACKAGE / "bench").glob("*.py")))
    commands = _lines(sorted((PACKAGE / "cli").glob("bench*.py")))
    product = _lines(sorted((PACKAGE / "decode").glob("*.py")) + sorted((PACKAGE / "model").glob("*.py")))
    assert bench <= 2500, f"bench/ has {bench} lines: what only measures our own runs belongs in tools/"
    assert 3 * (bench + commands) <= product, (bench, commands, product)

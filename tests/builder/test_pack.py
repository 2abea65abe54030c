"""`pack`: a model directory split into parts and joined back byte for byte, every part and file
checked by sha256; sizes read as K/M/G/T."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenswift_trt.builder.pack import (
    MANIFEST,
    PackError,
    PackManifest,
    join_parts,
    parse_size,
    split_directory,
)
from tokenswift_trt.builder.presets import REPOSITORY

SWIFT_TINY = REPOSITORY / "models/swift-tiny"


def _tree(directory):
    return {path.relative_to(directory).as_posix(): path.read_bytes() for path in directory.rglob("*")
            if path.is_file()}  # fmt: skip


@pytest.mark.parametrize(
    "text, size",
    [("40M", 40 << 20), ("1G", 1 << 30), ("512k", 512 << 10), ("4096", 4096), ("100MiB", 100 << 20),
     ("2 GB", 2 << 30), ("1T", 1 << 40)],
)  # fmt: skip
def test_sizes_are_read_in_powers_of_1024(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "0M", "-1M", "1.5G", "40X", "M", "40 M B", "ten"])
def test_bad_sizes_are_refused_in_one_line(text):
    with pytest.raises(PackError, match=r"^bad part size .*e\.g\. 40M or 1G$") as refused:
        parse_size(text)
    assert "\n" not in str(refused.value)


def test_a_model_split_into_parts_joins_back_identical(tmp_path):
    source = tmp_path / "model"
    shutil.copytree(SWIFT_TINY, source)
    (source / "nested").mkdir()
    (source / "nested" / "empty.txt").write_bytes(b"")
    part_size = 3 << 20
    manifest = split_directory(source, tmp_path / "parts", part_size)

    total = sum(len(data) for data in _tree(source).values())
    assert manifest.total_bytes == total and len(manifest.parts) == -(-total // part_size)
    assert all(part.size == part_size for part in manifest.parts[:-1])
    assert sorted(path.name for path in (tmp_path / "parts").iterdir()) == sorted(
        [MANIFEST, *(part.name for part in manifest.parts)]
    )
    assert PackManifest.read(tmp_path / "parts") == manifest  # the manifest file reads back the same
    record = json.loads((tmp_path / "parts" / MANIFEST).read_text())
    assert {file["path"] for file in record["files"]} == set(_tree(source))
    assert all(len(entry["sha256"]) == 64 for entry in record["files"] + record["parts"])

    joined = join_parts(tmp_path / "parts", tmp_path / "joined")
    assert _tree(joined) == _tree(source)
    with pytest.raises(PackError, match="not empty: choose another --out or pass --force"):
        join_parts(tmp_path / "parts", joined)
    assert _tree(join_parts(tmp_path / "parts", joined, force=True)) == _tree(source)


def _split(tmp_path):
    split_directory(SWIFT_TINY, tmp_path / "parts", 4 << 20)
    return tmp_path / "parts"


def test_a_corrupt_part_is_named_and_nothing_is_written(tmp_path):
    parts = _split(tmp_path)
    data = bytearray((parts / "part-00002.bin").read_bytes())
    data[1000] ^= 0xFF  # same size, one byte flipped
    (parts / "part-00002.bin").write_bytes(bytes(data))
    with pytest.raises(PackError, match=r"^part part-00002\.bin is corrupt .*copy it again") as refused:
        join_parts(parts, tmp_path / "joined")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "joined").exists() and not (tmp_path / "joined.joining").exists()


def test_a_missing_or_truncated_part_is_named_before_anything_is_written(tmp_path):
    parts = _split(tmp_path)
    (parts / "part-00001.bin").unlink()
    with pytest.raises(PackError, match=r"^part part-00001\.bin is missing from .*copy it from the source$"):
        join_parts(parts, tmp_path / "joined")
    (parts / "part-00001.bin").write_bytes(b"short")  # a copy cut off
    with pytest.raises(PackError, match=r"^part part-00001\.bin has 5 bytes, the manifest says 4,194,304"):
        join_parts(parts, tmp_path / "joined")
    assert not (tmp_path / "joined").exists()


def test_a_missing_or_unsafe_manifest_is_refused(tmp_path):
    parts = _split(tmp_path)
    manifest = json.loads((parts / MANIFEST).read_text())
    manifest["files"][0]["path"] = "../outside.txt"
    (parts / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PackError, match="names a file outside the model directory"):
        join_parts(parts, tmp_path / "joined")
    (parts / MANIFEST).unlink()
    with pytest.raises(PackError, match="manifest.json is missing: copy the manifest"):
        join_parts(parts, tmp_path / "joined")
    with pytest.raises(PackError, match="is inside the model directory"):
        split_directory(SWIFT_TINY, SWIFT_TINY / "parts", 1 << 20)
    with pytest.raises(PackError, match="is not empty"):
        split_directory(SWIFT_TINY, parts, 1 << 20)

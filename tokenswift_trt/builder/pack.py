"""Carry a model or engine directory to a machine without internet access, in parts of a chosen size.

`split_directory` reads every file under a directory (sorted by relative path) as one byte stream and
cuts it into parts of at most `part_size` bytes (`part-00000.bin`, ...), with `manifest.json`
recording each part's and each original file's size and sha256. `join_parts` checks that every part
is present with its recorded size, rebuilds the files while hashing, and refuses (one-line
`PackError`, nothing left behind) when a part or a file does not match its sha256. Parts can be
copied over any channel that limits a file's size; the manifest travels with them.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from tokenswift_trt.model.engine_dir import sha256_of

MANIFEST = "manifest.json"
PACK_FORMAT = 1
PART_NAME = "part-{:05d}.bin"
BLOCK = 1 << 20  # bytes read or written at a time
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)

Progress = Callable[[str, int, int], None]  # (stage, bytes done, bytes in all)


class PackError(ValueError):
    """A bad size, directory, part or manifest (the message names the fix, on one line)."""


@dataclass(frozen=True)
class PackedFile:
    path: str  # relative to the packed directory, "/"-separated
    size: int
    sha256: str


@dataclass(frozen=True)
class Part:
    name: str  # file name inside the parts directory
    size: int
    sha256: str


@dataclass(frozen=True)
class PackManifest:
    """What `split_directory` wrote: the files in stream order, then the parts that hold the stream."""

    part_size: int
    files: tuple[PackedFile, ...]
    parts: tuple[Part, ...]
    format: int = PACK_FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(file.size for file in self.files)

    def to_json(self) -> str:
        record = asdict(self)
        record["files"] = [asdict(file) for file in self.files]
        record["parts"] = [asdict(part) for part in self.parts]
        return json.dumps(record, indent=2) + "\n"

    @staticmethod
    def read(parts_dir: Path) -> PackManifest:
        path = Path(parts_dir) / MANIFEST
        if not Path(parts_dir).is_dir():
            raise PackError(f"parts directory {parts_dir} does not exist")
        if not path.is_file():
            raise PackError(f"{path} is missing: copy the manifest written by `pack split` with the parts")
        try:
            record = json.loads(path.read_text())
            if record.get("format") != PACK_FORMAT:
                raise PackError(
                    f"{path} has format {record.get('format')!r}, this version reads {PACK_FORMAT}: "
                    "split the model again with this version"
                )
            manifest = PackManifest(
                part_size=int(record["part_size"]),
                files=tuple(PackedFile(**file) for file in record["files"]),
                parts=tuple(Part(**part) for part in record["parts"]),
            )
        except PackError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise PackError(f"{path} is not a `pack split` manifest ({error}): copy it again") from None
        for file in manifest.files:
            relative = PurePosixPath(file.path)
            if relative.is_absolute() or ".." in relative.parts or not relative.parts:
                raise PackError(f"{path} names a file outside the model directory ({file.path!r})")
        if sum(part.size for part in manifest.parts) != manifest.total_bytes:
            raise PackError(f"{path} is inconsistent (its parts and files differ in size): copy it again")
        return manifest


def parse_size(text: str) -> int:
    """Bytes from "40M", "1G", "512K", "100MiB" or "4096" (K, M, G, T are powers of 1024)."""
    match = _SIZE.fullmatch(str(text))
    size = int(match[1]) * _UNITS[match[2].upper()] if match else 0
    if size <= 0:
        raise PackError(
            f"bad part size {text!r}: give a positive whole number of bytes with an optional K, M, G or T "
            "suffix, e.g. 40M or 1G"
        )
    return size


def _files_of(directory: Path) -> list[tuple[str, Path]]:
    found = [path for path in directory.rglob("*") if path.is_file()]
    return sorted((path.relative_to(directory).as_posix(), path) for path in found)


def split_directory(
    model_dir: Path, out_dir: Path, part_size: int, progress: Progress | None = None, force: bool = False
) -> PackManifest:
    """Write `model_dir`'s files as parts of at most `part_size` bytes plus `manifest.json` to `out_dir`."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if part_size <= 0:
        raise PackError(f"part size must be positive, got {part_size}")
    if not model_dir.is_dir():
        raise PackError(f"model directory {model_dir} does not exist")
    files = _files_of(model_dir)
    if not files:
        raise PackError(f"{model_dir} holds no files to pack")
    if out_dir.resolve() == model_dir.resolve() or model_dir.resolve() in out_dir.resolve().parents:
        raise PackError(f"--out {out_dir} is inside the model directory: choose a directory outside it")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise PackError(f"{out_dir} is not empty: choose another --out or pass --force to replace it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    total = sum(path.stat().st_size for _, path in files)
    packed: list[PackedFile] = []
    writer = _PartWriter(out_dir, part_size)
    done = 0
    for relative, path in files:
        digest, size = hashlib.sha256(), 0
        with path.open("rb") as handle:
            for block in iter(lambda handle=handle: handle.read(BLOCK), b""):
                digest.update(block)
                writer.write(block)
                size += len(block)
                done += len(block)
                if progress is not None:
                    progress("split", done, total)
        packed.append(PackedFile(relative, size, digest.hexdigest()))
    manifest = PackManifest(part_size, tuple(packed), tuple(writer.close()))
    (out_dir / MANIFEST).write_text(manifest.to_json())
    return manifest


class _PartWriter:
    """A byte stream cut into numbered part files of at most `part_size` bytes, each hashed."""

    def __init__(self, out_dir: Path, part_size: int) -> None:
        self.out_dir, self.part_size = out_dir, part_size
        self.parts: list[Part] = []
        self.handle: BinaryIO | None = None
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.handle is None:
                name = PART_NAME.format(len(self.parts))
                self.handle = (self.out_dir / name).open("wb")
                self.digest, self.size = hashlib.sha256(), 0
            room = self.part_size - self.size
            chunk = view[:room]
            self.handle.write(chunk)
            self.digest.update(chunk)
            self.size += len(chunk)
            view = view[len(chunk) :]
            if self.size == self.part_size:
                self._finish()

    def _finish(self) -> None:
        assert self.handle is not None
        self.handle.close()
        self.parts.append(Part(Path(self.handle.name).name, self.size, self.digest.hexdigest()))
        self.handle = None

    def close(self) -> list[Part]:
        if self.handle is not None:
            self._finish()
        return self.parts


def _checked_stream(parts_dir: Path, manifest: PackManifest, progress: Progress | None) -> Iterator[bytes]:
    """The parts' bytes in order; each part's sha256 is checked when its last byte has been read."""
    done, total = 0, manifest.total_bytes
    for part in manifest.parts:
        digest = hashlib.sha256()
        with (parts_dir / part.name).open("rb") as handle:
            for block in iter(lambda handle=handle: handle.read(BLOCK), b""):
                digest.update(block)
                done += len(block)
                if progress is not None:
                    progress("join", done, total)
                yield block
        if digest.hexdigest() != part.sha256:
            raise _corrupt(part, digest.hexdigest())


def _corrupt(part: Part, found: str) -> PackError:
    return PackError(
        f"part {part.name} is corrupt (sha256 {found[:12]}..., the manifest says {part.sha256[:12]}...): "
        "copy it again from the source"
    )


def find_corrupt_part(parts_dir: Path, manifest: PackManifest) -> PackError | None:
    """The error for the first part whose sha256 is not the manifest's, or None when all match."""
    for part in manifest.parts:
        found = sha256_of(Path(parts_dir) / part.name)
        if found != part.sha256:
            return _corrupt(part, found)
    return None


def join_parts(parts_dir: Path, out_dir: Path, progress: Progress | None = None, force: bool = False) -> Path:
    """Rebuild the packed directory at `out_dir` from `parts_dir`, checking every part and file by sha256.

    Nothing is left at `out_dir` when a part is missing, corrupt or of the wrong size.
    """
    parts_dir, out_dir = Path(parts_dir), Path(out_dir)
    manifest = PackManifest.read(parts_dir)
    for part in manifest.parts:  # missing or truncated parts are found before anything is written
        path = parts_dir / part.name
        if not path.is_file():
            raise PackError(
                f"part {part.name} is missing from {parts_dir} (the manifest lists {len(manifest.parts)} "
                "parts): copy it from the source"
            )
        if path.stat().st_size != part.size:
            raise PackError(
                f"part {part.name} has {path.stat().st_size:,} bytes, the manifest says {part.size:,}: "
                "copy it again from the source"
            )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise PackError(f"{out_dir} is not empty: choose another --out or pass --force to replace it")
    staging = out_dir.with_name(out_dir.name + ".joining")
    if staging.exists():
        shutil.rmtree(staging)
    try:
        try:
            _write_files(_checked_stream(parts_dir, manifest, progress), manifest, staging)
        except _FileMismatch as mismatch:  # a file ended before its part did: name the part when it is one
            raise find_corrupt_part(parts_dir, manifest) or PackError(str(mismatch)) from None
        if out_dir.is_dir():
            shutil.rmtree(out_dir)
        elif out_dir.exists():
            out_dir.unlink()
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


class _FileMismatch(Exception):
    """A joined file's sha256 is not the manifest's."""


def _write_files(stream: Iterator[bytes], manifest: PackManifest, staging: Path) -> None:
    pending = b""
    for file in manifest.files:
        target = staging / PurePosixPath(file.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, left = hashlib.sha256(), file.size
        with target.open("wb") as handle:
            while left:
                if not pending:
                    pending = next(stream, b"")
                    if not pending:
                        raise PackError(f"the parts end before {file.path} does: copy them again")
                chunk, pending = pending[:left], pending[left:]
                handle.write(chunk)
                digest.update(chunk)
                left -= len(chunk)
        if digest.hexdigest() != file.sha256:
            raise _FileMismatch(f"{file.path} does not match its sha256 after joining: split the model again")
    for _ in stream:  # read to the end, so the last part's sha256 is checked too
        pass

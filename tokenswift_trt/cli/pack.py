"""`pack split` and `pack join`: carry a model directory to a GPU node without internet access."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .common import fail


class PartSize(click.ParamType):
    """A size in bytes written as 40M, 1G, 512K or 4096 (powers of 1024)."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from tokenswift_trt.builder.pack import PackError, parse_size

        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except PackError as error:
            self.fail(str(error), param, ctx)


class _Bar:
    """A bytes progress bar on stderr, drawn from the first progress report on."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.bar: Any = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        from ..progress import progress_bar

        if self.bar is None:
            self.bar = progress_bar(
                total=total,
                desc=self.desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                leave=False,
                delay=2.0,  # shown only where it takes a while: a small model's split says one line
            )
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@click.group("pack")
def pack() -> None:
    """Carry a model to a machine without internet, in parts.

    Split a model or engine directory into parts of a chosen size, copy them over, and join them on
    the other machine; every part and file is checked by sha256."""


@pack.command("split")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option(
    "--part-size",
    type=PartSize(),
    default="1G",
    show_default=True,
    help="largest part, in bytes with an optional K, M, G or T suffix (powers of 1024), e.g. 40M",
)
@click.option(
    "--out", type=click.Path(path_type=Path), required=True, help="directory for the parts and manifest.json"
)
@click.option("--force", is_flag=True, help="replace a non-empty --out")
def split(model_dir: Path, part_size: int, out: Path, force: bool) -> None:
    """Cut MODEL_DIR into parts plus a sha256 manifest.

    Writes MODEL_DIR's files as numbered parts of at most --part-size bytes plus manifest.json (each
    part's and each file's size and sha256). Copy the whole --out directory to the other machine and
    run `tokenswift-trt pack join` there."""
    from tokenswift_trt.builder.pack import PackError, split_directory

    bar = _Bar("split")
    try:
        manifest = split_directory(model_dir, out, part_size, bar, force=force)
    except (PackError, OSError) as error:
        raise fail(error) from None
    finally:
        bar.close()
    click.echo(
        f"{len(manifest.files)} files, {manifest.total_bytes:,} bytes -> {len(manifest.parts)} parts "
        f"of at most {manifest.part_size:,} bytes in {out} (manifest.json lists them)"
    )


@pack.command("join")
@click.argument("parts_dir", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="model directory to write")
@click.option("--force", is_flag=True, help="replace a non-empty --out")
def join(parts_dir: Path, out: Path, force: bool) -> None:
    """Rebuild a model directory from its parts, checking every sha256.

    Reads PARTS_DIR as written by `tokenswift-trt pack split` (the parts and manifest.json) and
    writes the original files to --out. A missing, truncated or corrupt part is named in a one-line
    error and nothing is written."""
    from tokenswift_trt.builder.pack import PackError, PackManifest, join_parts

    bar = _Bar("join")
    try:
        join_parts(parts_dir, out, bar, force=force)
        manifest = PackManifest.read(parts_dir)
    except (PackError, OSError) as error:
        raise fail(error) from None
    finally:
        bar.close()
    click.echo(
        f"{len(manifest.files)} files, {manifest.total_bytes:,} bytes joined into {out}, every sha256 checked"
    )

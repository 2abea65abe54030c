"""`tokenswift-trt` command line: each module parses one group of commands, calls the runtime,
builder, bench or serving packages, and prints. No algorithm here."""

from __future__ import annotations

import sys

import click

from .batch import batch
from .bench import bench
from .bench_serve import bench_batching, bench_serve
from .bench_steps import bench_steps
from .build import build, presets, random_model
from .eval_heads import eval_heads
from .generate import demo, generate
from .pack import pack
from .serve import client, serve
from .train import draft_vocab, train_heads
from .train_data import train_data


class OneLineErrors(click.Group):
    """Every usage or input error becomes one line on stderr with exit code 2, never a traceback."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Abort:
            click.echo("tokenswift-trt: aborted", err=True)
            sys.exit(130)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.ClickException as error:
            message = error.format_message().replace("\n", " ")
            click.echo(f"tokenswift-trt: error: {message}", err=True)
            sys.exit(2)


@click.group(cls=OneLineErrors)
@click.version_option(package_name="tokenswift-trt")
def main() -> None:
    """Lossless TokenSwift acceleration of ultra-long generation."""


for command in (
    generate,
    batch,
    demo,
    build,
    presets,
    random_model,
    serve,
    client,
    bench,
    bench_steps,
    bench_serve,
    bench_batching,
    train_data,
    train_heads,
    eval_heads,
    draft_vocab,
    pack,
):
    main.add_command(command)

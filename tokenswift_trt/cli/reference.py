"""The CLI reference (docs/cli.md): every command's `--help`, rendered from the click commands.

    .venv/bin/python -m tokenswift_trt.cli.reference > docs/cli.md

The text is what `tokenswift-trt ... --help` prints at a fixed width of `WIDTH` columns, so it does
not depend on the terminal; tests/cli/test_cli_reference.py fails when docs/cli.md is out of date.
"""

from __future__ import annotations

from collections.abc import Iterator

import click

PROGRAM = "tokenswift-trt"
WIDTH = 100  # columns the help text is wrapped to
REGENERATE = ".venv/bin/python -m tokenswift_trt.cli.reference > docs/cli.md"


def help_context(command: click.Command, name: str, parent: click.Context | None) -> click.Context:
    """The context `tokenswift-trt ... --help` formats `command` in, at `WIDTH` columns."""
    return click.Context(
        command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH
    )


def walk(
    command: click.Command, name: str = PROGRAM, parent: click.Context | None = None
) -> Iterator[tuple[tuple[str, ...], click.Context]]:
    """(words after the program name, help context) of `command` and of every visible subcommand,
    depth first, subcommands in `list_commands` order (by name)."""
    context = help_context(command, name, parent)
    words = tuple(context.command_path.split()[1:])
    yield words, context
    if isinstance(command, click.Group):
        for sub_name in command.list_commands(context):
            sub = command.get_command(context, sub_name)
            if sub is not None and not sub.hidden:
                yield from walk(sub, sub_name, context)


def _anchor(words: tuple[str, ...]) -> str:
    return "-".join((PROGRAM, *words))


def render(command: click.Command) -> str:
    """docs/cli.md: an index of the commands with their one-line summaries, then each one's `--help`."""
    entries = list(walk(command))
    lines = [
        "# CLI reference",
        "",
        f"Every `{PROGRAM}` command with the text its `--help` prints, generated from the commands",
        f"themselves by `{REGENERATE}`",
        "(tests/cli/test_cli_reference.py fails when this file is out of date).",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    for words, context in entries[1:]:
        summary = context.command.get_short_help_str(limit=200).replace("|", "\\|")
        lines.append(f"| [`{' '.join(words)}`](#{_anchor(words)}) | {summary} |")
    for words, context in entries:
        lines += ["", f"## `{' '.join((PROGRAM, *words))}`", "", "```text", context.get_help(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    from . import main as program

    click.echo(render(program), nl=False, color=False)


if __name__ == "__main__":
    main()

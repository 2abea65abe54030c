"""Training text for the draft layers, read with Hugging Face `datasets`, and the prompts of a
`train-data` run (continuations the target samples itself, the text verification draws from).

    texts = read_texts([Path("data/corpus/moby_dick.txt.gz"), Path("prompts.parquet")])
    records = read_records([Path("runs/generated.jsonl")])     # text or token ids per record

A file is read by its extension: .txt (one document per file), .jsonl/.json, .parquet and .csv
(each row a record), each optionally compressed (.gz, .bz2, .xz, .zst); a folder stands for the
files of those kinds in it. A record's text is its `field` column ("text" by default); a results
file of `batch` or `train-data` also carries the tokens the target wrote (`token_ids`), which training
takes as they are rather than decoding and encoding them again. Records whose `status` is "failed"
are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.training.errors import TrainingError

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
TOKENS_FIELD = "token_ids"  # what `batch` and `train-data` write: the tokens the target sampled


@dataclass(frozen=True)
class Record:
    """One training document: its text, or the token ids the target wrote (then `text` is unused)."""

    text: str
    token_ids: tuple[int, ...] | None = None


def builder_of(path: Path) -> str | None:
    """The `datasets` builder for a data file ("text", "json", "parquet", "csv"), or None."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def data_files(paths: Sequence[Path]) -> dict[str, list[str]]:
    """Data files grouped by builder; a folder gives its readable files in name order."""
    grouped: dict[str, list[str]] = {}
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and builder_of(p) is not None)
        elif path.is_file():
            if builder_of(path) is None:
                kinds = ", ".join(sorted(BUILDERS))
                raise TrainingError(f"{path}: cannot read this kind of file; give {kinds} (or compressed)")
            files = [path]
        else:
            raise TrainingError(f"training data {path} does not exist")
        for file in files:
            grouped.setdefault(builder_of(file) or "", []).append(str(file))
    if not grouped:
        raise TrainingError("no training text found (give .txt, .jsonl, .parquet or .csv files)")
    return grouped


def _load(builder: str, files: list[str]) -> Any:
    """One `datasets` table of these files (the text builder keeps each file as one document)."""
    try:
        import datasets
    except ImportError:
        raise TrainingError(
            "reading training data needs Hugging Face datasets: pip install 'tokenswift-trt[train]'"
        ) from None
    options = {"sample_by": "document"} if builder == "text" else {}
    quiet = not datasets.utils.are_progress_bars_disabled()  # our callers show their own progress
    if quiet:
        datasets.utils.disable_progress_bars()
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **options)
    except Exception as error:  # datasets raises many kinds for an unreadable file; name the files
        while error.__cause__ is not None:  # "An error occurred while generating ..." wraps the cause
            error = error.__cause__
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TrainingError(f"cannot read {', '.join(files)}: {first}") from None
    finally:
        if quiet:
            datasets.utils.enable_progress_bars()


def read_records(paths: Sequence[Path], field: str = "text") -> list[Record]:
    """Every document of the files (see the module docstring), in order."""
    records: list[Record] = []
    for builder, files in data_files(paths).items():
        table = _load(builder, files)
        columns = set(table.column_names)
        text_field = "text" if builder == "text" else field
        if text_field not in columns and TOKENS_FIELD not in columns:
            raise TrainingError(
                f"{', '.join(files)}: no {text_field!r} column (it has {', '.join(sorted(columns))}): "
                "name the text's column with --field"
            )
        for row in table:
            if row.get("status") == "failed":
                continue
            ids = row.get(TOKENS_FIELD)
            if ids is not None:
                records.append(Record(str(row.get(text_field) or ""), tuple(int(i) for i in ids)))
            elif isinstance(row.get(text_field), str):
                records.append(Record(row[text_field]))
    if not records:
        raise TrainingError(f"no text in {', '.join(str(p) for p in paths)}")
    return records


def read_texts(paths: Sequence[Path], field: str = "text") -> list[str]:
    """The documents' texts (records that hold only token ids are skipped)."""
    texts = [record.text for record in read_records(paths, field) if record.token_ids is None]
    if not texts:
        raise TrainingError(f"no text in {', '.join(str(p) for p in paths)}")
    return texts


def record_ids(records: Sequence[Record], encode: Any, eos: Sequence[int]) -> torch.Tensor:
    """Records -> one stream of token ids [N], each record closed by EOS: token ids as written,
    text encoded with the model's tokenizer."""
    ids: list[int] = []
    for record in records:
        tokens = list(record.token_ids) if record.token_ids is not None else encode(record.text)
        ids.extend(tokens + list(eos))
    return torch.tensor(ids, dtype=torch.long)


def token_splits(
    records: Sequence[Record],
    eval_records: Sequence[Record],
    encode: Any,
    eos: Sequence[int],
    eval_fraction: float = 0.05,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training ids, held-out ids). Without `eval_records` the last `eval_fraction` of the training
    tokens is held out."""
    train_ids = record_ids(records, encode, eos)
    if eval_records:
        return train_ids, record_ids(eval_records, encode, eos)
    split = int(train_ids.numel() * (1 - eval_fraction))
    return train_ids[:split], train_ids[split:]


def prompt_windows(ids: torch.Tensor, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens at random starts of `ids` [N] (a generator seeded with
    `seed`: the same windows every time, so a rerun of `train-data` asks for the same requests)."""
    if ids.numel() <= length:
        raise TrainingError(f"only {ids.numel()} tokens of prompt text for prompts of {length}: add text")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length, (count,), generator=generator).tolist()
    return [ids[start : start + length].tolist() for start in starts]

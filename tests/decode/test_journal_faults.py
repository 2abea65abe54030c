"""Journals never destroy work and know their model; settings out of range are refused up front."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.journal import (
    JournalError,
    JournalWriter,
    check_new_journal,
    journal_header,
    model_identity,
    read_journal,
    resume_journal,
    unfinished_journal,
)
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.engine import load_engine
from tokenswift_trt.model.sampling import SamplingConfig

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
needs_model = pytest.mark.skipif(
    not (MODEL / "model.safetensors").is_file(), reason="models/swift-tiny is not in this checkout"
)
IDENTITY = {"name": "models/a", "vocab_size": 100, "dtype": "float32", "fingerprint": "aaaa"}


def _journal(path: Path, tokens: list[int], finished: bool = False, model: dict | None = IDENTITY) -> Path:
    config = GenerationConfig(max_new_tokens=8, seed=3)
    writer = JournalWriter(path, journal_header([1, 2], config, model=model))
    writer.add(tokens)
    writer.close(finished=finished)
    return path


def test_a_new_journal_may_replace_only_a_finished_journal_or_nothing(tmp_path):
    fresh = tmp_path / "sub" / "fresh.journal"
    check_new_journal(fresh, "--resume X", "delete it")
    assert not list(tmp_path.iterdir())  # probed, nothing left, no directory made before the run

    unfinished = _journal(tmp_path / "a.journal", [5, 6, 7])
    assert unfinished_journal(unfinished) is not None
    with pytest.raises(
        JournalError, match=r"unfinished generation \(3 of 8 tokens\): continue it with R, or S"
    ):
        check_new_journal(unfinished, "R", "S")
    with pytest.raises(JournalError, match="^request_id a holds an unfinished"):
        check_new_journal(unfinished, "resume=true", "send a new request_id", label="request_id a")

    for done in (
        _journal(tmp_path / "b.journal", [5], finished=True),
        _journal(tmp_path / "c.journal", [5] * 8),
    ):
        assert unfinished_journal(done) is None  # a finished record, or every token written
        check_new_journal(done, "R", "S")

    empty = tmp_path / "empty"
    empty.touch()
    check_new_journal(empty, "R", "S")  # as `mktemp` leaves it
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(JournalError, match="not a tokenswift journal"):
        check_new_journal(notes, "R", "S")
    with pytest.raises(JournalError, match="is a directory: name a file"):
        check_new_journal(tmp_path, "R", "S")
    with pytest.raises(JournalError, match=r"cannot write the journal .*notes.txt is a file, not a dir"):
        check_new_journal(notes / "x.journal", "R", "S")
    assert notes.read_text() == "keep me"


def test_a_writer_that_cannot_write_leaves_no_temporary_file(tmp_path):
    header = journal_header([1], GenerationConfig(max_new_tokens=2, seed=0))
    (tmp_path / "dir").mkdir()
    with pytest.raises(JournalError, match="is a directory"):
        JournalWriter(tmp_path / "dir", header)
    with pytest.raises(JournalError, match="cannot write the journal"):
        JournalWriter(Path("/proc/tokenswift-no-such-dir/run.journal"), header)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    with pytest.raises(JournalError, match="is a directory: give the journal file"):
        read_journal(tmp_path / "dir")  # --resume DIR


def test_resume_refuses_another_model_or_dtype_and_checks_old_journals_by_vocabulary(tmp_path):
    path = _journal(tmp_path / "a.journal", [5, 6])
    assert resume_journal(path, [], model=IDENTITY).done_ids == [5, 6]
    other = {**IDENTITY, "name": "models/b", "fingerprint": "bbbb"}
    with pytest.raises(
        JournalError, match=r"written by models/a \(.*aaaa\), not by this model, models/b \(.*bbbb"
    ):
        resume_journal(path, [], model=other)
    with pytest.raises(JournalError, match="vocabulary 100.*vocabulary 50"):
        resume_journal(path, [], model={**IDENTITY, "vocab_size": 50, "fingerprint": ""})
    with pytest.raises(JournalError, match=r"bfloat16.*--dtype float32"):
        resume_journal(path, [], model={**IDENTITY, "dtype": "bfloat16"})
    # output-deciding kernel settings must match; speed-only ones may change; unrecorded: not checked
    kernels = KernelConfig(batch_invariant="on", huge_pages=False).to_dict()
    written = _journal(tmp_path / "k.journal", [5, 6], model={**IDENTITY, "kernels": kernels})
    with pytest.raises(
        JournalError,
        match=r"output-deciding kernel settings .*\(batch_invariant=off\): resume it with "
        r"--kernel batch_invariant=on$",
    ):
        resume_journal(written, [], model={**IDENTITY, "kernels": KernelConfig().to_dict()})
    speed_only = KernelConfig(batch_invariant="on", screened_head=False).to_dict()
    assert resume_journal(written, [], model={**IDENTITY, "kernels": speed_only}).done_ids == [5, 6]
    assert resume_journal(path, [], model={**IDENTITY, "kernels": kernels}).done_ids == [5, 6]
    assert resume_journal(path, [], model={**IDENTITY, "fingerprint": ""}).done_ids == [5, 6]  # not known

    old = _journal(tmp_path / "old.journal", [5, 60], model=None)
    assert "model" not in read_journal(old).header
    assert resume_journal(old, [], model={**IDENTITY, "vocab_size": 61}).done_ids == [5, 60]
    with pytest.raises(JournalError, match="token id 60, outside this model's vocabulary of 60"):
        resume_journal(old, [], model={**IDENTITY, "vocab_size": 60})


@needs_model
def test_the_fingerprint_names_the_model_in_every_dtype(tmp_path):
    float32 = load_engine(MODEL)
    bfloat16 = load_engine(MODEL, dtype=torch.bfloat16)
    other = load_engine(write_random_model(tmp_path / "other", seed=1))
    assert len(float32.fingerprint) == 16 and float32.fingerprint == bfloat16.fingerprint != other.fingerprint
    identity = model_identity(bfloat16, "tiny")
    assert identity == {
        "name": "tiny",
        "vocab_size": 8192,
        "dtype": "bfloat16",
        "fingerprint": float32.fingerprint,
        "kernels": KernelConfig().to_dict(),  # the kernel settings it runs with
    }


@pytest.mark.parametrize("temperature", [float("inf"), 1e300, float("nan"), -1.0, 100.5])
def test_temperature_outside_0_to_100_is_refused(temperature):
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 100\]"):
        SamplingConfig(temperature=temperature).validate()
    with pytest.raises(GenerationError, match="temperature"):
        GenerationConfig(max_new_tokens=1, sampling=SamplingConfig(temperature=temperature)).validate()


def test_boundary_values_are_accepted():
    SamplingConfig(temperature=100.0, penalty=1e6).validate()
    SamplingConfig(temperature=0.0).validate()
    GenerationConfig(max_new_tokens=1, max_length=2, memory_budget=1, tree="1023").validate()


@pytest.mark.parametrize(
    "change,match",
    [
        ({"sampling": SamplingConfig(penalty=float("inf"))}, "penalty must be in"),
        ({"sampling": SamplingConfig(penalty=float("nan"))}, "penalty must be in"),
        ({"max_length": 0}, "max length must be at least 2"),
        ({"max_length": -1}, "max length must be at least 2"),
        ({"memory_budget": 0}, "memory budget must be positive"),
        ({"tree": "1024"}, "'1024' has 1,025 nodes"),
    ],
)
def test_bad_settings_are_refused_by_validate(change, match):
    with pytest.raises(GenerationError, match=match):
        dataclasses.replace(GenerationConfig(max_new_tokens=4), **change).validate()


def test_a_huge_tree_is_refused_before_anything_is_built():
    started = time.perf_counter()
    with pytest.raises(GenerationError, match=r"tree '300,300' has 90,301 nodes.*or the tree auto"):
        GenerationConfig(max_new_tokens=4, tree="300,300").validate()
    with pytest.raises(GenerationError, match="nodes"):
        GenerationConfig(max_new_tokens=4, tree="1000,1000,1000,1000,1000,1000,1000,1000").validate()
    assert time.perf_counter() - started < 0.5


@needs_model
def test_an_admission_refusal_dominated_by_the_tree_names_the_tree():
    engine = load_engine(MODEL)
    config = GenerationConfig(max_new_tokens=4, tree="31,31", memory_budget=1 << 20, draft_source="verify")
    with pytest.raises(
        GenerationError,
        match=r"not enough memory.*tree '31,31'.*smaller tree or n-gram top-k, or the tree auto",
    ):
        generate(engine, [1, 2, 3], config)


def test_an_admission_refusal_of_auto_asks_for_memory_not_for_auto():
    engine = load_engine(MODEL)
    config = GenerationConfig(max_new_tokens=4, memory_budget=1 << 20)
    with pytest.raises(GenerationError, match=r"auto's probe tree.*give a larger memory budget$"):
        generate(engine, [1, 2, 3], config)

"""The library's entry points: load, generate (AR's tokens), a journaled run resumed after a crash."""

from __future__ import annotations

import pytest

import tokenswift_trt as ts
from tokenswift_trt.api import resume_run, start_run
from tokenswift_trt.decode.request import config_from


@pytest.fixture(scope="module")
def model():
    return ts.load("swift-tiny")


def test_generate_emits_ar_tokens_greedy_and_seeded(model):
    for settings in ({"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}):
        swift = ts.generate(model, "Once upon a time", 48, **settings)
        ar = ts.generate(model, "Once upon a time", 48, method="ar", **settings)
        assert swift.token_ids == ar.token_ids and len(swift.token_ids) == 48
        assert swift.text == model.codec.decode(swift.token_ids)
        assert swift.stats is not None and swift.stats.method == "tokenswift"


class _Crash(Exception):
    pass


def test_a_crashed_journaled_run_resumes_to_the_same_tokens(model, tmp_path):
    journal = tmp_path / "run.journal"
    config = config_from(model.defaults, {"max_new_tokens": 64, "temperature": 1.0, "seed": 5})
    whole = start_run(model, "The river", config).execute()

    seen: list[int] = []

    def crash_after_20(ids: list[int]) -> None:
        seen.extend(ids)
        if len(seen) >= 20:
            raise _Crash

    run = start_run(model, "The river", config, journal=journal, journal_every=1)
    with pytest.raises(_Crash):
        run.execute(crash_after_20)
    resumed = resume_run(journal, model)
    assert 0 < len(resumed.done_ids) < 64 and not resumed.finished
    assert resumed.execute().token_ids == whole.token_ids
    assert resume_run(journal, model).finished  # nothing left to run
    start_run(model, "x", config, journal=journal)  # a finished journal may be replaced


def test_an_unfinished_journal_is_never_replaced(model, tmp_path):
    journal = tmp_path / "run.journal"
    config = config_from(model.defaults, {"max_new_tokens": 32})

    def crash(ids: list[int]) -> None:
        raise _Crash

    with pytest.raises(_Crash):
        start_run(model, "A", config, journal=journal, journal_every=1).execute(crash)
    with pytest.raises(ts.ApiError, match="--resume"):
        start_run(model, "B", config, journal=journal)


def test_bad_requests_are_one_line_api_errors(model, tmp_path):
    with pytest.raises(ts.ApiError, match="unknown setting"):
        ts.generate(model, "x", 4, temprature=0.0)
    with pytest.raises(ts.ApiError, match="unknown preset"):
        ts.load("no-such-model")
    with pytest.raises(ts.ApiError, match="does not exist"):
        ts.load(model_dir=tmp_path / "missing")
    with pytest.raises(ts.ApiError, match="keeps the journal's own settings"):
        resume_run(tmp_path / "any.journal", model, {"temperature": 0.5})


def test_load_takes_str_paths_as_well_as_paths(model):
    from pathlib import Path

    directory = model.origin.model_dir
    loaded = ts.load(model_dir=str(directory))
    assert loaded.origin.model_dir == Path(directory) and isinstance(loaded.origin.model_dir, Path)
    prompt = loaded.codec.encode("It is a truth")
    assert (
        ts.generate(loaded, prompt, 4, method="ar", temperature=0, penalty=1.0).token_ids
        == ts.generate(model, prompt, 4, method="ar", temperature=0, penalty=1.0).token_ids
    )

"""Progress bars in a log file: a line per redraw, few redraws; on a terminal, tqdm's own bar."""

from __future__ import annotations

import io

from tokenswift_trt import progress
from tokenswift_trt.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_in_a_log_writes_lines_at_most_every_interval_and_its_final_state(monkeypatch):
    log = io.StringIO()  # not a terminal, as a CI log or a redirected stderr
    with progress_bar(file=log, total=5000, desc="AR + TokenSwift", unit="tok") as bar:
        for _ in range(5000):
            bar.update(1)
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # the first redraw and the final state: 5,000 updates well inside LOG_INTERVAL_S
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1].startswith("AR + TokenSwift: 100%") and "5000/5000" in lines[-1]
    # with no interval every update is a line of its own, still without carriage returns
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    log = io.StringIO()
    with progress_bar(file=log, total=50, miniters=1) as bar:
        for _ in range(50):
            bar.update(1)
    assert "\r" not in log.getvalue() and len(log.getvalue().splitlines()) > 40


def test_a_bar_left_on_close_in_a_log_leaves_no_blank_lines():
    log = io.StringIO()
    bar = progress_bar(file=log, total=3, leave=False)
    bar.update(3)
    bar.close()
    assert all(line.strip() for line in log.getvalue().splitlines())


def test_a_bar_on_a_terminal_redraws_in_place():
    screen = Terminal()
    with progress_bar(file=screen, total=10, mininterval=0, miniters=1) as bar:
        for _ in range(10):
            bar.update(1)
    assert screen.getvalue().count("\r") >= 10


def test_a_bar_only_for_terminals_stays_off_in_a_log():
    log = io.StringIO()
    with progress_bar(file=log, total=3, disable=None) as bar:
        bar.update(3)
    assert log.getvalue() == ""
    screen = Terminal()
    with progress_bar(file=screen, total=3, disable=None, mininterval=0) as bar:
        bar.update(3)
    assert "3/3" in screen.getvalue()

from __future__ import annotations

import pytest

from tokenswift_trt.bench.metrics import acceptance_rate, distinct_n, speedup, spread


def test_distinct_n_hand_computed():
    tokens = [1, 2, 1, 2, 1, 3]
    assert distinct_n(tokens, 1) == pytest.approx(3 / 6)  # {1, 2, 3}
    assert distinct_n(tokens, 2) == pytest.approx(3 / 5)  # (1,2) (2,1) (1,3)
    assert distinct_n(tokens, 3) == pytest.approx(3 / 4)  # (1,2,1) (2,1,2) (2,1,3)
    assert distinct_n(tokens, 4) == pytest.approx(3 / 3)
    assert distinct_n([7] * 10, 2) == pytest.approx(1 / 9)
    assert distinct_n([1, 2], 3) == 0.0


def test_rates_and_speedup_hand_computed():
    assert acceptance_rate(84, 100) == pytest.approx(0.84)
    assert acceptance_rate(0, 0) == 0.0
    # AR: 100 tokens in 10 s (0.1 s/token); TokenSwift: 120 tokens in 4 s (1/30 s/token) -> 3x
    assert speedup(10.0, 100, 4.0, 120) == pytest.approx(3.0)
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)

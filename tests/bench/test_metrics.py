from __future__ import annotations

import pytest

from tokenswift_trt.bench.metrics import acceptance_rate, distinct_n, spread


def test_distinct_n_hand_computed():
    tokens = [1, 2, 1, 2, 1, 3]
    assert distinct_n(tokens, 1) == pytest.approx(3 / 6)  # {1, 2, 3}
    assert distinct_n(tokens, 2) == pytest.approx(3 / 5)  # (1,2) (2,1) (1,3)
    assert distinct_n(tokens, 3) == pytest.approx(3 / 4)  # (1,2,1) (2,1,2) (2,1,3)
    assert distinct_n(tokens, 4) == pytest.approx(3 / 3)
    assert distinct_n([7] * 10, 2) == pytest.approx(1 / 9)
    assert distinct_n([1, 2], 3) == 0.0


def test_rates_and_spread_hand_computed():
    assert acceptance_rate(84, 100) == pytest.approx(0.84)
    assert acceptance_rate(0, 0) == 0.0
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)

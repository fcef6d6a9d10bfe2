"""The confidence interval that benchmarks/overhead.py puts on its median ratios."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from overhead import median_interval  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("n", "ranks"), [(6, (1, 6)), (10, (2, 9)), (41, (14, 28)), (100, (40, 61))])
def test_the_median_interval_takes_the_order_statistics_of_the_binomial_tables(n, ranks):
    values = [float(v) for v in range(1, n + 1)]
    random.Random(n).shuffle(values)
    assert median_interval(values) == (float(ranks[0]), float(ranks[1]))


def test_too_few_values_give_no_interval():
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None


def test_the_interval_holds_the_median_of_a_skewed_distribution_at_least_95_percent_of_the_time():
    rng, true_median, draws = random.Random(0), 0.6931471805599453, 2000  # exponential(1): ln 2
    covered = sum(lo <= true_median <= hi for lo, hi in
                  (median_interval([rng.expovariate(1.0) for _ in range(41)]) for _ in range(draws)))
    assert 0.95 <= covered / draws <= 0.99

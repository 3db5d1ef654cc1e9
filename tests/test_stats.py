"""torchrl_oni.stats' paired comparisons against SciPy (skipped where SciPy is not installed)."""
import numpy as np
import pytest

from torchrl_oni.stats import mcnemar_exact, paired_difference, sign_flip_p

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("counts", [(0, 0), (1, 0), (10, 2), (2, 10), (5, 3), (7, 7), (40, 25)])
def test_mcnemar_exact_is_scipy_binomtest(counts):
    first, second = counts
    expected = 1.0 if first + second == 0 else scipy_stats.binomtest(first, first + second).pvalue
    assert mcnemar_exact(first, second) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_sign_flip_p_is_scipy_exact_permutation_test(seed):
    rng = np.random.default_rng(seed)
    d = np.round(rng.normal(0.02 * seed, 0.08, size=3 + seed), 3)  # rounded: ties between patterns
    expected = scipy_stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=np.inf,
                                            alternative="two-sided").pvalue
    assert sign_flip_p(d) == pytest.approx(expected, abs=1e-12)


def test_sign_flip_p_draws_patterns_past_the_exact_limit():
    d = np.full(18, 0.05)
    d[:5] *= -1
    exact = sign_flip_p(d, exact_up_to=18)
    assert sign_flip_p(d) == pytest.approx(exact, abs=0.005)  # 200,000 random patterns of 2^18


@pytest.mark.parametrize("seed", range(4))
def test_paired_difference_is_scipy_paired_t_interval(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(0, 0.3, size=8), rng.uniform(0, 0.3, size=8)
    r = paired_difference(a, b)
    ci = scipy_stats.ttest_rel(a, b).confidence_interval()
    assert r["mean"] == pytest.approx(float(np.mean(a - b)))
    # our t quantiles come from a 3-decimal table
    assert r["ci95"] == pytest.approx([ci.low, ci.high], abs=1e-3 * (ci.high - ci.low))
    assert r["excludes_zero"] == (ci.low > 0 or ci.high < 0)
    assert r["wins"] == [int((a > b).sum()), int((a < b).sum())]
    assert r["n"] == 8


def test_paired_difference_refuses_unpaired_values():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([0.1, 0.2], [0.1])

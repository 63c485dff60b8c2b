"""costmodel/fit/nnls.py: the one non-negative least-squares solver the step and probe fits share."""

from __future__ import annotations

import pytest

from costmodel.fit.nnls import nnls_rel, solve_spd


def _rows(coef, xs):
    return [sum(c * v for c, v in zip(coef, x)) for x in xs]


def test_exact_data_gives_back_its_coefficients_across_twelve_orders_of_magnitude():
    xs = [[1.0, t, t * t, b] for t, b in ((16, 1), (128, 8), (512, 2), (2048, 4), (4096, 16), (64, 32))]
    coef = [5e-3, 2e-5, 3e-10, 1e-4]
    got, err = nnls_rel(xs, _rows(coef, xs))
    assert got == pytest.approx(coef, rel=1e-9) and err < 1e-12


def test_a_term_the_data_would_make_negative_is_zero_not_negative():
    xs = [[1.0, t] for t in (10, 20, 40, 80)]
    got, _ = nnls_rel(xs, [1.0 - 0.001 * t for t in (10, 20, 40, 80)])  # falls with t: slope < 0 unconstrained
    assert got[1] == 0.0 and got[0] > 0


def test_one_row_for_two_terms_prices_it_with_one():
    got, err = nnls_rel([[1024.0, 1024.0**2]], [0.04])
    assert sum(v > 0 for v in got) == 1 and err == pytest.approx(0.0, abs=1e-15)


def test_collinear_and_zero_columns_are_skipped_not_solved():
    xs = [[1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [3.0, 6.0, 0.0]]  # column 1 is twice column 0, column 2 empty
    got, err = nnls_rel(xs, [0.5, 1.0, 1.5])
    assert got[2] == 0.0 and got[0] + 2 * got[1] == pytest.approx(0.5) and err < 1e-12


def test_error_is_relative_to_rel_when_given():
    xs = [[1.0], [1.0]]
    _, err = nnls_rel(xs, [1.0, 3.0], rel=[10.0, 10.0])
    assert err == pytest.approx(0.1)  # coef 2: residuals -1 and 1 over 10


def test_refuses_non_positive_timings():
    for y, rel in (([0.1, 0.0], None), ([], None), ([0.1, 0.2], [1.0, -1.0])):
        with pytest.raises(ValueError):
            nnls_rel([[1.0]] * len(y), y, rel)
    with pytest.raises(ValueError, match="every column"):
        nnls_rel([[0.0], [0.0]], [0.1, 0.2])


def test_solve_spd_says_singular():
    assert solve_spd([[1.0, 0.5], [0.5, 1.0]], [1.5, 1.5]) == pytest.approx([1.0, 1.0])
    assert solve_spd([[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0]) is None

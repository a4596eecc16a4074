"""Eval statistics on inputs with published answers (statsmodels / R values)."""

from __future__ import annotations

import math
import random

import pytest

from lopd_cli.results.evaluate import (
    EpisodeFigures,
    category_rows,
    comparison_rows,
    markdown_table,
    mean_interval,
    spread,
    summarize_figures,
    t_quantile_975,
    wilson_interval,
)


def test_wilson_8_of_10_matches_statsmodels():
    # statsmodels.stats.proportion.proportion_confint(8, 10, method="wilson")
    iv = wilson_interval(8, 10)
    assert iv.estimate == 0.8
    assert iv.low == pytest.approx(0.4901625, abs=1e-6)
    assert iv.high == pytest.approx(0.9433178, abs=1e-6)


def test_wilson_edges_stay_inside_0_1_and_are_not_points():
    zero, full = wilson_interval(0, 10), wilson_interval(10, 10)
    assert zero.low == 0.0 and zero.high == pytest.approx(0.2775328, abs=1e-6)
    assert full.high == pytest.approx(1.0) and full.low == pytest.approx(0.7224672, abs=1e-6)
    assert wilson_interval(0, 0).estimate is None
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_t_interval_matches_r_t_test():
    # R: t.test(c(1, 2, 3, 4))$conf.int = 0.4457397 4.5542603
    iv = mean_interval([1, 2, 3, 4])
    assert iv.estimate == 2.5
    assert (iv.low, iv.high) == (pytest.approx(0.4457397, abs=1e-6), pytest.approx(4.5542603, abs=1e-6))
    one = mean_interval([0.7])
    assert one.estimate == 0.7 and one.low is None and one.half_width is None


@pytest.mark.parametrize("df,expected", [(1, 12.706205), (9, 2.262157), (30, 2.042272), (31, 2.039513), (40, 2.021075), (120, 1.979930), (10_000, 1.960201)])
def test_t_quantiles(df, expected):
    assert t_quantile_975(df) == pytest.approx(expected, abs=1e-5)


def test_t_interval_covers_the_true_mean_about_95_percent():
    rng = random.Random(0)
    trials, hits = 2000, 0
    for _ in range(trials):
        iv = mean_interval([rng.gauss(1.0, 2.0) for _ in range(8)])
        hits += iv.low <= 1.0 <= iv.high
    assert abs(hits / trials - 0.95) < 0.015


def fig(reward: float, category: str | None = None, calls: int = 2) -> EpisodeFigures:
    return EpisodeFigures(reward=reward, success=reward >= 1.0, tool_calls=calls, repeated_calls=calls // 2,
                          invalid_calls=0, first_turn_tokens=10 * calls, category=category)


def test_summary_per_category_and_tables():
    figures = [fig(1.0, "simple")] * 3 + [fig(0.0, "simple")] + [fig(0.5, "multiple", calls=4)] * 2
    res = summarize_figures("student", figures)
    assert res.n == 6
    assert res.success.estimate == pytest.approx(3 / 6)
    assert res.reward.estimate == pytest.approx(4 / 6)
    assert res.behaviour["tool_calls"].estimate == pytest.approx(16 / 6)
    assert set(res.categories) == {"simple", "multiple"}
    assert res.categories["simple"].success.estimate == 0.75 and res.categories["simple"].n == 4
    assert res.categories["multiple"].success.estimate == 0.0

    base = summarize_figures("backbone", [fig(0.0, "simple")] * 4 + [fig(0.0, "multiple")] * 2)
    header, rows = comparison_rows([base, res])
    assert [r[0] for r in rows] == ["backbone", "student"]
    assert rows[1][2].startswith("50.0 %")
    md = markdown_table(header, rows)
    assert md.count("\n") == 3 and md.startswith("| model |")
    cheader, crows = category_rows([base, res])
    assert cheader == ["category", "n", "backbone", "student"]
    assert [r[0] for r in crows] == ["multiple", "simple"]
    assert crows[1][3].startswith("75.0 %")
    assert math.isclose(res.to_dict()["success"]["low"], wilson_interval(3, 6).low)


def test_spread_keeps_every_category_of_an_ordered_split():
    items = [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)] + [f"c{i}" for i in range(10)]
    picked = spread(items, 6)
    assert len(picked) == len(set(picked)) == 6
    assert {p[0] for p in picked} == {"a", "b", "c"}
    assert spread(items, None) == items and spread(items, 100) == items

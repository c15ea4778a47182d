"""The repetition measure every benchmark row reports (cascade/repetition.py), on
hand-made sequences."""
from __future__ import annotations

import pytest

from cascade.repetition import is_loop, median_repetition, repetition


def test_no_repeated_4gram_scores_zero():
    assert repetition([]) == 0.0
    assert repetition([7]) == 0.0
    assert repetition(list(range(50))) == 0.0
    # every token repeats, but no 4-gram does
    assert repetition([1, 2, 3, 1, 2, 4, 1, 2, 5]) == 0.0


def test_a_token_counts_when_the_4gram_ending_at_it_occurred_earlier():
    # a b c d a b c d: the 4-grams end at positions 3..7; only "a b c d" ending at 7 was seen (at 3)
    assert repetition([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 8)
    # one more period: positions 8..11 close "b c d a", "c d a b", "d a b c", "a b c d", all seen
    assert repetition([1, 2, 3, 4] * 3) == pytest.approx(5 / 12)
    # occurrences may overlap: a a a a a a -> positions 4 and 5 close "a a a a", first seen at 3
    assert repetition([9] * 6) == pytest.approx(2 / 6)


def test_the_first_three_tokens_never_count():
    assert repetition([5, 5, 5]) == 0.0
    assert repetition([5, 5, 5, 5]) == 0.0  # one 4-gram, seen for the first time
    # a loop fills most of a long continuation: of 96 tokens, all from position 12 on (the three
    # 4-grams of the period first close at 9, 10, 11)
    loop = [1, 2, 3, 4, 5, 6] + [10, 11, 12] * 30
    assert repetition(loop) == pytest.approx(84 / 96) and is_loop(loop)


def test_other_n_and_the_median():
    assert repetition([1, 2, 1, 2], n=2) == pytest.approx(1 / 4)
    assert repetition([1, 1, 1], n=1) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="n"):
        repetition([1, 2], n=0)
    assert median_repetition([[1] * 10, list(range(10)), [2] * 10]) == pytest.approx(6 / 10)
    assert median_repetition([]) == 0.0


def test_loop_threshold():
    assert not is_loop(list(range(40)))
    assert is_loop([1, 2, 3, 4] * 10)
    assert not is_loop([1, 2, 3, 4] * 2)  # 1/8 < 0.2

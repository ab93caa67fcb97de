"""dflash.lookup: prompt-lookup drafts (n-gram match in prompt + output)."""

from __future__ import annotations

import pytest

from dflash_trt.dflash.lookup import lookup_drafts


def test_copies_what_followed_the_first_earlier_occurrence():
    history = [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3]
    assert lookup_drafts(history, 3) == [4, 9, 1]  # "1 2 3" first at 0, not the later one at 5


def test_longer_ngrams_win_over_earlier_shorter_ones():
    history = [9, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    # the 3-gram "1 2 3" occurred at 4 (-> 8); the 2-gram "2 3" first at 1 (-> 7)
    assert lookup_drafts(history, 2) == [8, 1]
    assert lookup_drafts(history, 2, max_ngram=2) == [7, 1]


def test_needs_min_ngram_tokens_of_match():
    assert lookup_drafts([5, 6, 7, 1, 8], 4) == []  # no n-gram of the tail occurred before
    assert lookup_drafts([5, 8, 6, 8], 2) == []  # "8" occurred, but a 1-gram is below MIN_NGRAM
    assert lookup_drafts([5, 8, 6, 8], 2, min_ngram=1) == [6, 8]


@pytest.mark.parametrize(("history", "k", "expected"), [
    ([1, 2, 1, 2], 5, [1, 2]),  # the continuation ends where the history does
    ([1, 2, 3, 1, 2], 0, []),
    ([1], 3, []),
    ([], 3, []),
    ((4, 4, 4, 4), 2, [4]),  # overlapping occurrences count; input may be any sequence
])
def test_edges(history, k, expected):
    assert lookup_drafts(history, k) == expected

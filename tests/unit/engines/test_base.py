"""collect(): acceptance lengths leave the prefill's token out, as `eval` and the server do."""

from dflash_trt.engines.base import StepOutput, collect


def test_collect_excludes_prefill_from_acceptance():
    steps = [StepOutput((5,), "a", 0, 0), StepOutput((1, 2, 3), "bcd", 7, 2),
             StepOutput((4,), "e", 7, 0, finished=True, finish_reason="length")]
    result = collect(iter(steps))
    assert result.text == "abcde" and result.token_ids == [5, 1, 2, 3, 4]
    assert result.acceptance_lengths == [3, 1] and result.acceptance_length == 2.0
    assert result.total_draft_tokens == 14 and result.total_accepted_draft_tokens == 2
    assert result.finish_reason == "length"


def test_collect_of_a_prefill_only_response():
    result = collect(iter([StepOutput((5,), "a", 0, 0, finished=True, finish_reason="eos")]))
    assert result.acceptance_lengths == [] and result.acceptance_length == 0.0

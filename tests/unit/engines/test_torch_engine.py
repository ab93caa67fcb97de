"""engines.torch_engine and the engine CLI commands, on a tiny checkpoint with a byte tokenizer."""

from __future__ import annotations

import json
import threading

import pytest
from click.testing import CliRunner
from dflash_fixtures import byte_tokenizer, write_tiny_checkpoint, write_tiny_drafter

from dflash_trt.commands.engine import COMMANDS
from dflash_trt.engines.base import Engine, SamplingParams, collect
from dflash_trt.engines.detokenize import IncrementalDetokenizer, StopWordFilter, complete_text
from dflash_trt.errors import UsageError

COMMAND = {c.name: c for c in COMMANDS}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    target = write_tiny_checkpoint(root / "target")
    return target, write_tiny_drafter(target, root / "drafter")


@pytest.fixture(scope="module")
def engine(dirs):
    from dflash_trt.engines.torch_engine import TorchEngine

    return TorchEngine.load(dirs[0], dirs[1], max_seq_len=256)


def test_engine_protocol_and_defaults(engine):
    assert isinstance(engine, Engine)
    assert engine.block_size == 4
    assert engine.stop_token_ids == [2]
    assert engine.drafter.mask_token_id == 3  # <mask>: the tokenizer's only non-role special


def test_speculative_equals_plain_and_text_matches_tokens(engine):
    for prompt in ["hello", "The quick brown fox", "élan 中文"]:
        ids = engine.tokenize(prompt, chat=True)
        plain = collect(engine.stream(ids, SamplingParams(max_new_tokens=40, num_draft_tokens=0)))
        spec = collect(engine.stream(ids, SamplingParams(max_new_tokens=40)))
        assert spec.token_ids == plain.token_ids
        assert spec.text == complete_text(engine.tokenizer.decode(spec.token_ids,
                                                                  skip_special_tokens=True))
        assert plain.total_draft_tokens == 0 and spec.total_draft_tokens > 0
        assert all(1 <= n <= 4 for n in spec.acceptance_lengths)


def test_prompt_lookup_reaches_generation_and_marks_its_steps(engine, monkeypatch):
    """The random tiny target never repeats itself, so lookup is an oracle here (dflash.lookup
    itself is tested in test_lookup.py and test_generate.py)."""
    from dflash_trt.dflash import generate as gen

    ids = engine.tokenize("abc", chat=False)
    plain = collect(engine.stream(ids, SamplingParams(max_new_tokens=13, num_draft_tokens=0)))
    monkeypatch.setattr(gen, "lookup_drafts",
                        lambda history, k: plain.token_ids[len(history) - len(ids):][:k])
    assert {s.draft_source for s in engine.stream(ids, SamplingParams(max_new_tokens=13))} \
        == {None, "dflash"}  # off by default
    monkeypatch.setattr(engine, "prompt_lookup", True)
    steps = list(engine.stream(ids, SamplingParams(max_new_tokens=13)))
    assert [t for s in steps for t in s.token_ids] == plain.token_ids
    assert [s.draft_source for s in steps] == [None, "lookup", "lookup", "lookup"]
    assert [len(s.token_ids) for s in steps] == [1, 4, 4, 4]


def test_num_draft_tokens_caps_each_step(engine):
    steps = list(engine.stream(engine.tokenize("abc"), SamplingParams(max_new_tokens=12,
                                                                     num_draft_tokens=2)))
    assert max(s.num_draft_tokens for s in steps) == 2
    assert steps[-1].finished and steps[-1].finish_reason in ("length", "eos")


def test_stop_words_cut_the_text(engine):
    ids = engine.tokenize("stop words")
    full = collect(engine.stream(ids, SamplingParams(max_new_tokens=40))).text
    word = full[10:12]
    cut = collect(engine.stream(ids, SamplingParams(max_new_tokens=40, stop_words=(word,))))
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.find(word)]


def test_closing_a_stream_early_releases_the_lock(engine):
    stream = engine.stream(engine.tokenize("x"), SamplingParams(max_new_tokens=30))
    next(stream)
    assert engine._lock.locked()
    stream.close()
    assert not engine._lock.locked()
    assert len(collect(engine.stream(engine.tokenize("x"), SamplingParams(max_new_tokens=3))).token_ids) == 3


def test_concurrent_callers_get_their_own_results(engine):
    prompts = ["one", "two", "three"]
    expected = [collect(engine.stream(engine.tokenize(p), SamplingParams(max_new_tokens=10))).token_ids
                for p in prompts]
    results = [None] * 3

    def worker(i):
        results[i] = collect(engine.stream(engine.tokenize(prompts[i]),
                                           SamplingParams(max_new_tokens=10))).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_prompt_lookup_without_a_drafter_is_refused(dirs):
    from dflash_trt.engines.torch_engine import TorchEngine

    with pytest.raises(UsageError, match="prompt lookup"):
        TorchEngine.load(dirs[0], None, prompt_lookup=True)
    result = CliRunner().invoke(COMMAND["generate"], [
        "--target", str(dirs[0]), "--prompt", "hi", "--prompt-lookup"])
    assert result.exit_code == 2 and "prompt lookup" in result.output


@pytest.mark.parametrize(("params", "match"), [
    (SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (SamplingParams(max_new_tokens=300), "max_seq_len"),
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
])
def test_bad_requests_are_usage_errors(engine, params, match):
    with pytest.raises(UsageError, match=match):
        next(engine.stream([5, 6], params))
    assert not engine._lock.locked()


def test_incremental_detokenizer_never_splits_a_character():
    tok = byte_tokenizer()
    text = "a é 中文 🙂 z"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in tok.encode(text)]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 6  # the bytes inside multi-byte characters wait


def test_a_text_cut_inside_a_character_ends_before_it():
    tok = byte_tokenizer()
    ids = tok.encode("a é 中文 🙂 z")
    for cut in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tok)
        text = "".join(detok.push([t]) for t in ids[:cut]) + detok.flush()
        assert text == complete_text(tok.decode(ids[:cut]))
        assert not text.endswith("\ufffd")
    assert complete_text("ab\ufffd") == "ab" and complete_text("\ufffdab") == "\ufffdab"


def test_streamed_text_equals_the_offline_text_when_max_tokens_cuts_a_character(engine):
    ids = engine.tokenize("hello", chat=True)
    full = collect(engine.stream(ids, SamplingParams(max_new_tokens=40))).token_ids
    decode = engine.tokenizer.decode
    cuts = [k for k in range(1, len(full) + 1)
            if decode(full[:k], skip_special_tokens=True).endswith("\ufffd")][:4]
    assert cuts  # the tiny model writes raw bytes: some prefixes end inside a character
    for k in cuts:
        params = SamplingParams(max_new_tokens=k)
        steps = list(engine.stream(ids, params))
        streamed = "".join(step.text for step in steps)
        offline = collect(engine.stream(ids, params))
        assert offline.token_ids == full[:k]
        assert streamed == offline.text == complete_text(decode(full[:k], skip_special_tokens=True))
        assert not steps[-1].text.endswith("\ufffd") and not streamed.endswith("\ufffd")


def test_stop_word_filter_holds_back_partial_matches():
    f = StopWordFilter(["END"])
    assert f.push("abc E") == ("abc ", False)
    assert f.push("N") == ("", False)
    assert f.push("Dxyz") == ("", True)
    g = StopWordFilter(["END"])
    assert g.push("EN") == ("", False)
    assert g.push("x") == ("ENx", False)


def test_cli_generate_json_fields(dirs):
    result = CliRunner().invoke(COMMAND["generate"], [
        "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompt", "hi", "--chat",
        "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output.strip().splitlines()[-1])
    for key in ("prompt", "text", "token_ids", "num_new_tokens", "acceptance_lengths",
                "mean_acceptance_length", "prefill_s", "decode_s", "tokens_per_s"):
        assert key in row
    assert row["num_new_tokens"] == len(row["token_ids"]) <= 8


def test_cli_generate_adaptive_draft_length_gives_the_same_tokens(dirs):
    rows = {}
    for mode in ("fixed", "adaptive"):
        result = CliRunner().invoke(COMMAND["generate"], [
            "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompt", "hello", "--chat",
            "--max-new-tokens", "24", "--json", "--draft-length", mode])
        assert result.exit_code == 0, result.output
        rows[mode] = json.loads(result.output.strip().splitlines()[-1])
    assert rows["adaptive"]["token_ids"] == rows["fixed"]["token_ids"]
    # block 4: three drafts on every drafter step (0 while a missing drafter rests)
    assert 3 in rows["fixed"]["draft_lengths"] and set(rows["fixed"]["draft_lengths"]) <= {0, 3}
    assert all(0 <= k <= 3 for k in rows["adaptive"]["draft_lengths"])
    no_drafter = CliRunner().invoke(COMMAND["generate"], [
        "--target", str(dirs[0]), "--prompt", "hi", "--draft-length", "adaptive"])
    assert no_drafter.exit_code == 2 and "needs a drafter" in no_drafter.output


def test_cli_generate_needs_one_prompt_source(dirs):
    result = CliRunner().invoke(COMMAND["generate"], ["--target", str(dirs[0])])
    assert result.exit_code == 2 and "--prompt" in result.output


def test_cli_eval_passes_and_writes_a_report(dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    report = tmp_path / "r.json"
    result = CliRunner().invoke(COMMAND["eval"], [
        "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompts", str(prompts),
        "--max-new-tokens", "12", "--report", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["num_identical"] == data["num_prompts"] == 2
    assert sum(data["acceptance_histogram"].values()) > 0
    assert data["prompt_lookup"] is False and data["num_lookup_steps"] == 0
    assert data["num_mismatches"] == data["num_near_ties"] == 0
    assert [r["status"] for r in data["prompts"]] == ["identical", "identical"]
    # every decode step drafts (no back-off in eval) but a prompt's last, when only the bonus fits
    profile = data["acceptance_profile"]
    steps = sum(data["acceptance_histogram"].values())
    assert steps - 2 <= profile["drafter_steps"] <= steps
    assert profile["drafter_steps"] == profile["position_acceptance"][0]["reached"]
    assert report.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "P(draft i accepted" in result.output


def test_cli_eval_reports_the_full_vocabulary_figure_for_a_draft_vocabulary(dirs, tmp_path):
    import shutil

    from dflash_trt.dflash.drafter import write_draft_vocab

    drafter = tmp_path / "drafter"
    shutil.copytree(dirs[1], drafter)
    write_draft_vocab(drafter, list(range(0, 128, 2)))  # drafts even token ids only
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    report = tmp_path / "r.json"
    result = CliRunner().invoke(COMMAND["eval"], [
        "--target", str(dirs[0]), "--drafter", str(drafter), "--prompts", str(prompts),
        "--max-new-tokens", "12", "--report", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["mean_acceptance_length_full_vocab"] >= 1.0
    assert "drafting the full vocabulary" in result.output
    plain = CliRunner().invoke(COMMAND["eval"], [
        "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompts", str(prompts),
        "--max-new-tokens", "4", "--report", str(report)])
    assert json.loads(report.read_text())["mean_acceptance_length_full_vocab"] is None, plain.output

    from dflash_trt.engines.torch_engine import TorchEngine
    from dflash_trt.stages.verify import full_vocab_lengths

    engine = TorchEngine.load(dirs[0], drafter, max_seq_len=256)
    vocab = engine.drafter.draft_vocab
    lengths = full_vocab_lengths(engine, [engine.tokenize("hi")], 8)
    assert lengths and engine.drafter.draft_vocab is vocab  # restored after the run


def test_cli_eval_with_prompt_lookup_counts_its_steps(dirs, tmp_path, monkeypatch):
    from dflash_trt.dflash import generate as gen

    monkeypatch.setattr(gen, "lookup_drafts", lambda history, k: [0] * k)  # drafts, always wrong
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc"}\n')
    report = tmp_path / "r.json"
    result = CliRunner().invoke(COMMAND["eval"], [
        "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompts", str(prompts),
        "--max-new-tokens", "24", "--prompt-lookup", "--report", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["num_identical"] == 1 and data["prompt_lookup"] is True
    assert 0 < data["num_lookup_steps"] == data["prompts"][0]["num_lookup_steps"]
    assert f"prompt lookup drafted {data['num_lookup_steps']} of" in result.output


def test_cli_eval_exits_1_when_outputs_differ(dirs, tmp_path, monkeypatch):
    from dflash_trt.dflash import generate as gen

    monkeypatch.setattr(gen, "accept_greedy", lambda logits, drafts: (len(drafts), 0))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    result = CliRunner().invoke(COMMAND["eval"], [
        "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompts", str(prompts),
        "--max-new-tokens", "12"])
    assert result.exit_code == 1
    assert "differ" in result.output


def test_cli_generate_builtin_prompt_set_first_n(dirs):
    result = CliRunner().invoke(COMMAND["generate"], [
        "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompts-file", "builtin:chat",
        "--num-prompts", "2", "--max-new-tokens", "4", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and rows[0]["prompt"] != rows[1]["prompt"]


def test_cli_eval_unknown_prompt_set_is_usage_error(dirs):
    result = CliRunner().invoke(COMMAND["eval"], [
        "--target", str(dirs[0]), "--drafter", str(dirs[1]), "--prompts", "builtin:nope"])
    assert result.exit_code == 2 and "builtin:nope" in result.output

"""Incremental detokenization (UTF-8 safe) and stop strings across token boundaries."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(text_checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(text_checkpoint)


def stream(tok: Tokenizer, ids: list[int], stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok.decode, [], list(stop))
    deltas = []
    for i in ids:
        detok.add(i)
        deltas.append(detok.take_delta())
        if detok.stopped:
            break
    deltas.append(detok.take_delta(final=True))
    return deltas, detok


def byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per byte (the byte-level alphabet), so multi-byte characters span tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    mapped = ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    return [tok._tok.token_to_id(ch) for piece, _ in mapped for ch in piece]


def test_multibyte_character_split_over_tokens_is_never_broken(tok):
    text = "naïve ✓ 🙂!"
    ids = byte_tokens(tok, text)
    assert len(ids) == len(text.encode())
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    n = len(ids)  # the emoji is bytes n-5 .. n-2: nothing is released until its last byte
    assert deltas[n - 5:n - 1] == ["", "", "", "\U0001f642"]


def test_merged_tokens_decode_like_a_full_decode(tok):
    text = "def fibonacci(n):\n    return héllo(n - 1)\n"
    ids = tok.encode(text)
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text


@pytest.mark.parametrize("source", ["checkpoint", "demo"])
def test_tokens_added_together_give_the_text_of_tokens_added_one_by_one(tok, source):
    """`add_many` (a speculative step's accepted tokens) against `add` token by token: the same
    text after every step, whatever the steps' sizes, multi-byte characters split over tokens,
    merged tokens and random ids included; and the same deltas once each step's are taken."""
    import random
    from pathlib import Path

    if source == "demo":
        tok = Tokenizer.from_dir(Path(__file__).resolve().parents[2] / "models" / "demo")
    rng = random.Random(3)
    texts = ["naïve ✓ 🙂!\n", "def f(x):\n    return x ** 2  # héllo\n", "日本語のテキスト",
             "  spaces   and\ttabs\n"]
    for case in range(60):
        text = "".join(rng.choice(texts) for _ in range(3))
        ids = byte_tokens(tok, text) if case % 3 == 0 else tok.encode(text)
        if case % 3 == 2:
            ids = [rng.randrange(tok.vocab_size) for _ in range(40)]
        one, many = IncrementalDetokenizer(tok.decode, [5, 6], []), IncrementalDetokenizer(tok.decode, [5, 6], [])
        i = 0
        while i < len(ids):
            step = ids[i:i + rng.randint(1, 6)]
            for t in step:
                one.add(t)
            many.add_many(step)
            i += len(step)
            assert many.text == one.text, (case, i)
            assert many.take_delta() == one.take_delta()
        assert many.take_delta(final=True) == one.take_delta(final=True)


def test_stop_string_spanning_tokens_is_cut_and_never_sent(tok):
    text = "import os\nimport sys\n\nclass Foo:\n"
    ids = byte_tokens(tok, text)
    deltas, detok = stream(tok, ids, stop=["sys\n\nclass"])
    assert detok.stopped
    assert "".join(deltas) == "import os\nimport "
    assert not any("sy" in d for d in deltas)  # held back while it could start the stop string


def test_held_back_text_is_released_when_it_is_not_a_stop(tok):
    deltas, detok = stream(tok, byte_tokens(tok, "a-b-c"), stop=["-x"])
    assert not detok.stopped and "".join(deltas) == "a-b-c"
    assert deltas[1] == ""  # "-" waited for the next character


def test_engine_applies_stop_strings_and_reports_stop(text_checkpoint):
    llm = LLM(text_checkpoint)
    free_run = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(free_run.text) > 4
    stop = free_run.text[2:4]
    out = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason_str == "stop"
    assert out.text == free_run.text[:free_run.text.find(stop)]
    deltas = [o.new_text for o in llm.stream("def ", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    assert "".join(deltas) == free_run.text


def test_an_engine_without_text_outputs_still_stops_at_stop_strings(text_checkpoint):
    """A serving worker's engine (`text_outputs` False: the router detokenizes) leaves the text out
    of requests without stop strings, with the same tokens, and still ends a request at its stop
    string, on the same token as an engine that keeps text."""
    llm = LLM(text_checkpoint)
    free_run = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = free_run.text[2:4]
    with_text = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0]
    llm.engine.text_outputs = False
    plain = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert plain.token_ids == free_run.token_ids and plain.text == ""
    stopped = llm.generate(["def "], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert stopped.finish_reason_str == "stop" and stopped.token_ids == with_text.token_ids
    assert len(stopped.token_ids) < len(free_run.token_ids)

"""Workloads repeat exactly from a seed, honour their length distributions, and cut the standard
library's source (in tokens with a tokenizer, in characters without)."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from pdserve.loadgen.lengths import LengthDistribution, LengthKind
from pdserve.loadgen.workload import WorkloadConfig, WorkloadKind, build_workload, load_tokenizer, stdlib_sources


def test_length_specs_parse_and_draw_within_bounds():
    rng = random.Random(0)
    assert LengthDistribution.parse("fixed:12").sample(rng) == 12
    uni = LengthDistribution.parse("uniform:5,9")
    assert {uni.sample(rng) for _ in range(500)} == set(range(5, 10))
    capped = LengthDistribution.parse("lognormal:100,1.0,150")
    draws = [capped.sample(rng) for _ in range(2000)]
    assert max(draws) == 150 and min(draws) >= 1 and capped.max_value == 150
    lognormal = LengthDistribution.parse("lognormal:100,0.5")
    assert statistics.fmean(lognormal.sample(rng) for _ in range(20000)) == pytest.approx(100, rel=0.05)
    assert lognormal.kind is LengthKind.LOGNORMAL and lognormal.spec == "lognormal:100,0.5"


@pytest.mark.parametrize("spec, match", [("zipf:3", "unknown length distribution"), ("fixed:0", ">= 1"),
                                         ("uniform:9,5", "low <= high"), ("uniform:5", "parameters"),
                                         ("lognormal:10,-1", "sigma"), ("fixed:a", "numbers")])
def test_bad_length_specs_say_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        LengthDistribution.parse(spec)


def test_random_workload_is_seeded_and_exact():
    cfg = WorkloadConfig(WorkloadKind.RANDOM, LengthDistribution.parse("uniform:3,30"),
                         LengthDistribution.parse("fixed:7"), vocab_size=50)
    a, b = build_workload(cfg, 40, seed=5), build_workload(cfg, 40, seed=5)
    assert a == b and a != build_workload(cfg, 40, seed=6)
    assert build_workload(cfg, 10, seed=5) == a[:10]  # fewer requests: the same first ones
    for spec in a:
        assert 3 <= len(spec.prompt) <= 30 and spec.num_prompt_tokens == len(spec.prompt)
        assert all(0 <= t < 50 for t in spec.prompt) and spec.max_tokens == 7


def test_code_workload_cuts_the_stdlib_in_characters():
    files = stdlib_sources()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    cfg = WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse("uniform:10,40"),
                         LengthDistribution.parse("fixed:4"), chars_per_token=3.0)
    a = build_workload(cfg, 20, seed=1)
    assert a == build_workload(cfg, 20, seed=1) and a != build_workload(cfg, 20, seed=2)
    corpus = {f: f.read_text(encoding="utf-8", errors="replace") for f in files}
    for spec in a:
        assert isinstance(spec.prompt, str) and 30 <= len(spec.prompt) <= 120 and len(spec.prompt) % 3 == 0
        assert any(spec.prompt in text for text in corpus.values())


def test_code_workload_cuts_exact_token_counts_with_a_tokenizer(text_checkpoint):
    cfg = WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse("uniform:20,60"),
                         LengthDistribution.parse("fixed:4"), tokenizer=str(text_checkpoint))
    a = build_workload(cfg, 15, seed=3)
    assert a == build_workload(cfg, 15, seed=3)
    vocab = load_tokenizer(str(text_checkpoint)).get_vocab_size()
    for spec in a:
        assert isinstance(spec.prompt, tuple) and 20 <= len(spec.prompt) <= 60
        assert spec.num_prompt_tokens == len(spec.prompt) and all(0 <= t < vocab for t in spec.prompt)


def test_jsonl_workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "max_tokens": 3}) + "\n\n" + json.dumps({"prompt": [1, 2, 3]}) + "\n")
    cfg = WorkloadConfig(WorkloadKind.JSONL, output_len=LengthDistribution.parse("fixed:9"), dataset=str(path))
    a = build_workload(cfg, 6, seed=0)
    assert a == build_workload(cfg, 6, seed=0)
    assert {(s.prompt, s.max_tokens) for s in a} == {("hello", 3), ((1, 2, 3), 9)}
    path.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: 'prompt'"):
        build_workload(cfg, 1, seed=0)
    path.write_text('{"prompt": "ok", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=r":1: 'max_tokens'"):
        build_workload(cfg, 1, seed=0)
    with pytest.raises(ValueError, match="not a file"):
        WorkloadConfig(WorkloadKind.JSONL, dataset=str(tmp_path / "missing.jsonl"))


def test_each_run_gets_prompts_of_its_own_of_the_same_lengths():
    """`pdserve bench` sends every rate the same requests; their heads differ per run, so a
    server's prefix cache cannot serve one run from another's K/V (tokens and text alike)."""
    from pdserve.loadgen.bench import HEAD_TOKENS, own_prompts

    cfg = WorkloadConfig(WorkloadKind.RANDOM, LengthDistribution.parse("uniform:2,40"),
                         LengthDistribution.parse("fixed:7"), vocab_size=50)
    base = build_workload(cfg, 30, seed=1)
    a, b = own_prompts(base, "x/0", 50), own_prompts(base, "x/1", 50)
    assert a == own_prompts(base, "x/0", 50)  # the same key: the same prompts
    for s, x, y in zip(base, a, b):
        assert len(x.prompt) == len(y.prompt) == len(s.prompt) and x.max_tokens == s.max_tokens
        n = min(HEAD_TOKENS, len(s.prompt))
        assert x.prompt[n:] == s.prompt[n:] and all(3 <= t < 50 for t in x.prompt[:n])
    assert sum(x.prompt != y.prompt for x, y in zip(a, b)) >= 29  # 4 ids of 47: a tie is ~2e-7
    text = [type(base[0])("def fibonacci(n):\n    return n", 5)]
    t0, t1 = own_prompts(text, "x/0", 50)[0].prompt, own_prompts(text, "x/1", 50)[0].prompt
    assert len(t0) == len(t1) == len(text[0].prompt) and t0 != t1 and t0[8:] == text[0].prompt[8:]


def test_a_built_workload_is_kept_for_the_next_call_but_a_jsonl_file_is_read_again(tmp_path):
    from pdserve.loadgen.workload import _built, _cutter

    cfg = WorkloadConfig(WorkloadKind.CODE, LengthDistribution.parse("uniform:10,40"),
                         LengthDistribution.parse("fixed:4"), chars_per_token=2.0)
    hits = _built.cache_info().hits
    a = build_workload(cfg, 12, seed=3)
    b = build_workload(cfg, 12, seed=3)
    assert a == b and a is not b and _built.cache_info().hits == hits + 1
    b.pop()  # each call's list is its own
    assert build_workload(cfg, 12, seed=3) == a
    assert _cutter(cfg) is _cutter(cfg)  # another seed reuses the files already read
    data = tmp_path / "w.jsonl"
    data.write_text(json.dumps({"prompt": "one", "max_tokens": 2}) + "\n")
    jcfg = WorkloadConfig(WorkloadKind.JSONL, dataset=str(data))
    assert [s.prompt for s in build_workload(jcfg, 1, seed=0)] == ["one"]
    data.write_text(json.dumps({"prompt": "two", "max_tokens": 2}) + "\n")
    assert [s.prompt for s in build_workload(jcfg, 1, seed=0)] == ["two"]

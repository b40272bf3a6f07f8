"""Graph capture (`engine/capture.py`): a captured forward computes what the eager one does.

The CPU capture compiles the model at start-up (tens of seconds); one engine covers batch 1 and a
batch of several sequences, prefill chunks, decode steps and speculative verification, greedy and
seeded sampling, through the two graphs it traces (planned steps, and steps with prefill chunks)."""
from __future__ import annotations

import gc
import types

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.capture import CompiledForward
from pdserve.engine.config import EngineConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 40)), [11, 12, 13] * 10]
# prompts whose one chunk is past a native plan's limit as `_short_native_plans` sets it (by
# default a native plan takes any chunk): prefill steps that run the per-sequence path
LONG = [list(range(3, 40)) * 8, [11, 12, 13, 14] * 70]


def _short_native_plans(*llms: LLM) -> None:
    """Native plans for chunks of up to 200 x 200 (queries x context) on the tiny model's 2 heads
    per KV head."""
    for llm in llms:
        llm.engine.runner.inputs.max_native_scores = 2 * 200 * 200


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama")


@pytest.mark.slow
@pytest.mark.parametrize("cpu_attention", ["native", "torch"])  # paged_attention_cpu, or write_and_attend
def test_compiled_forward_gives_the_eager_tokens(target, cpu_attention):
    # cpu_linear="torch": with packed projections the native forward (`NativeForward`) would take
    # the planned steps from the graph (tests/kernels/test_native_forward.py)
    options = dict(speculative_method="ngram", num_speculative_tokens=3, spec_adaptive=False,
                   cpu_attention=cpu_attention, cpu_linear="torch")
    eager, compiled = LLM(target, **options), LLM(target, graph_capture="compile", **options)
    _short_native_plans(eager, compiled)
    capture = compiled.engine.runner.capture
    graphs = capture.num_graphs  # the warm-up compiled them
    assert capture is not None and capture.compile_seconds > 0  # compiled at start-up, not in a request
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=5)):
        # 21 sequences and more: the input buffers grow
        for prompts in (PROMPTS[:1], PROMPTS + LONG[:1], LONG[1:] + PROMPTS * 7):
            want = [o.token_ids for o in eager.generate(prompts, params)]
            assert [o.token_ids for o in compiled.generate(prompts, params)] == want
    assert not capture.is_broken and compiled.engine.speculator.stats.num_drafts > 0
    # both graphs ran: prefill for the long prompts (and, with torch plans, for any chunk past 16 tokens)
    assert capture.num_steps["prefill"] > 1 and capture.num_steps["planned"] > 1
    # planned steps called their graph straight, not through Dynamo; the prefill graph takes a
    # stride among its inputs, which a straight call would not check, so it stays behind Dynamo
    assert capture.calls_straight("planned" if cpu_attention == "native" else "planned (torch)")
    assert not capture.calls_straight("prefill")
    if cpu_attention == "native":  # the same steps through Dynamo, guards and all: still one planned graph
        runner = compiled.engine.runner
        checked = runner.capture = CompiledForward(runner.model, runner.kv_caches, straight=False)
        params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=5)
        for prompts in (PROMPTS[:1], PROMPTS * 7):
            assert [o.token_ids for o in compiled.generate(prompts, params)] == \
                [o.token_ids for o in eager.generate(prompts, params)]
        assert checked.num_steps["planned"] > 1 and not checked.calls_straight("planned")
        # one graph for every planned step it ran (and one for prefill chunks, if any ran: the
        # prompts' blocks are cached by now, so their prefill steps may all be planned)
        assert checked.num_graphs == 1 + bool(checked.num_steps["prefill"] + checked.num_steps["mixed"])
    # one graph for every batch size and length, and for buffers grown mid-request: nothing
    # recompiled after the warm-up
    assert capture.num_graphs == graphs >= 1


@pytest.mark.slow
def test_engines_of_one_model_class_keep_their_own_graphs(target, checkpoint):
    """Each compiled forward guards only its step's inputs (not the model's parameters or the KV
    caches), which is sound only because each has graphs of its own: two models of the same class,
    with KV caches of one shape but MLPs of two widths, compiled in one process and run in turn,
    each give their eager tokens (sharing graphs, the second would run the first's shapes)."""
    other = checkpoint("llama", seed=1, intermediate_size=96)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # cpu_linear="torch": with packed projections every step runs natively and nothing is compiled
    engines = {path: (LLM(path, cpu_linear="torch"), LLM(path, graph_capture="compile", cpu_linear="torch"))
               for path in (target, other)}
    for _ in range(2):
        for eager, compiled in engines.values():
            assert [o.token_ids for o in compiled.generate(PROMPTS, params)] == \
                [o.token_ids for o in eager.generate(PROMPTS, params)]
    captures = [compiled.engine.runner.capture for _, compiled in engines.values()]
    assert all(not c.is_broken and c.num_graphs >= 1 for c in captures)
    assert captures[0]._code is not captures[1]._code


@pytest.mark.slow
def test_compiled_prefill_steps_mix_chunks_and_decode_tokens(target):
    """With a small token budget, prompts arrive in chunks beside other sequences' decode tokens:
    those steps run through the compiled prefill graph (`write_and_split_attend`) and give the
    eager tokens. The engine starts with compiling's garbage already collected."""
    # chunks of a few hundred tokens, past a native plan (`_short_native_plans`), beside decode
    # tokens; no prefix caching, so the repeated prompts are chunked again
    options = dict(max_num_batched_tokens=400, enable_prefix_caching=False, cpu_linear="torch")
    eager = LLM(target, **options)
    gc.collect()
    compiled = LLM(target, graph_capture="compile", **options)
    _short_native_plans(eager, compiled)
    # the garbage compiling left was collected at start, not left for a full collection inside
    # the first requests' steps (400 ms in one step of the demo pair's first request)
    assert gc.collect() < 50
    prompts = [[5, 6, 7] * 150, list(range(3, 40)) * 12, [11, 12, 13] * 10] * 3
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == want
    steps = compiled.engine.runner.capture.num_steps
    assert steps["mixed"] > 0 and steps["prefill"] > 0, steps


def test_with_the_native_forward_taking_every_step_nothing_is_compiled(target):
    """Packed projections and native attention (the CPU's defaults): every step, prefill chunks of
    any length included, runs as one native call, so `graph_capture="compile"` builds no compiled
    forward for it (its start-up seconds saved) and gives the eager tokens."""
    compiled = LLM(target, graph_capture="compile")
    if compiled.engine.runner.native_forward is None:
        pytest.skip("no native forward on this CPU (the projections are not packed)")
    assert compiled.engine.runner.capture is None
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS + LONG
    want = [o.token_ids for o in LLM(target).generate(prompts, params)]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == want


def test_graph_capture_option_is_validated():
    with pytest.raises(ValueError, match="graph_capture"):
        EngineConfig(model="m", graph_capture="sometimes")
    with pytest.raises(ValueError, match="cpu_attention"):
        EngineConfig(model="m", cpu_attention="fast")
    with pytest.raises(ValueError, match="cpu_linear"):
        EngineConfig(model="m", cpu_linear="fast")


def test_a_kept_graph_is_called_straight_only_while_it_is_its_functions_one_graph():
    """`_KeptGraph` (a draft's passes call their graphs through it): the graph called straight,
    on inputs it was not traced with, computes what the function does; a second graph of the same
    function (a kept guard failed) turns the straight call off; an input it cannot name keeps it off."""
    from pdserve.engine.capture import _KeptGraph

    model = torch.nn.Linear(3, 4)

    def project(self, state: torch.Tensor) -> torch.Tensor:
        return self(state.float()).sum(-1) + state.shape[1]

    kept = _KeptGraph({})
    fn = torch.compile(types.MethodType(project, model), backend=kept, fullgraph=True)
    traced = torch.arange(6).view(2, 3)
    torch._dynamo.decorators.mark_unbacked(traced, 0)
    assert torch.equal(fn(traced), project(model, traced))
    assert kept.num_graphs == 1 and kept.call is not None
    other = torch.arange(15).view(5, 3) - 7  # another batch size, never traced
    assert torch.allclose(kept.call({"state": other}), project(model, other))
    fn(traced.double())  # a kept guard (the dtype) fails: Dynamo compiles a second graph
    assert kept.num_graphs == 2 and kept.call is None

    unnamed = _KeptGraph({})
    torch.compile(lambda x, y: x + y, backend=unnamed, fullgraph=True)(torch.ones(2), torch.ones(2))
    assert unnamed.num_graphs == 1 and unnamed.call is None  # 'x' and 'y' are no pass's inputs

    # a step's forward: tensors reached from an input by attributes, and their sizes
    def gather(self, ids: torch.Tensor, meta) -> torch.Tensor:
        return self(meta.plan.table[ids].float()).sum(-1) + meta.plan.table.shape[0]

    by_attribute = _KeptGraph({}, roots=("ids", "meta"))
    fn = torch.compile(types.MethodType(gather, model), backend=by_attribute, fullgraph=True)
    meta = types.SimpleNamespace(plan=types.SimpleNamespace(table=torch.arange(12).view(4, 3)))
    ids = torch.tensor([0, 2])
    for t in (ids, meta.plan.table):
        torch._dynamo.decorators.mark_unbacked(t, 0)
    assert torch.equal(fn(ids, meta), gather(model, ids, meta))
    assert by_attribute.call is not None
    other = types.SimpleNamespace(plan=types.SimpleNamespace(table=torch.arange(21).view(7, 3) - 5))
    assert torch.allclose(by_attribute.call({"ids": torch.tensor([6, 1, 3]), "meta": other}),
                          gather(model, torch.tensor([6, 1, 3]), other))


def test_native_attention_gives_the_torch_tokens(target):
    """The native attention (`kernels/native.py`) against the torch path, eagerly: greedy and
    seeded sampling, plain decoding and speculative verification of ragged depths."""
    options = dict(speculative_method="ngram", num_speculative_tokens=3)
    native, torch_path = LLM(target, cpu_attention="native", **options), LLM(target, cpu_attention="torch", **options)
    assert native.engine.runner.inputs.native_plans and not torch_path.engine.runner.inputs.native_plans
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)):
        want = [o.token_ids for o in torch_path.generate(PROMPTS * 3, params)]
        assert [o.token_ids for o in native.generate(PROMPTS * 3, params)] == want
    assert native.engine.speculator.stats.num_drafts > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_graphs_need_cuda(target):
    with pytest.raises(ValueError, match="needs a CUDA device and the Triton kernels"):
        LLM(target, graph_capture="cuda_graphs")


def test_cuda_graph_bucket_padding_computes_the_same_rows(target):
    """What a CUDA graph replays, run eagerly on the CPU: a decode step of 3 sequences written
    into the fixed input buffers, padded to the bucket of 4 (slot -1, context 1 over block 0),
    block tables at full width. Its first 3 rows are the plain step's, and the padding row
    writes nothing into the cache."""
    from pdserve.engine.cuda_graphs import CudaGraphForward, bucket_sizes
    from pdserve.engine.model_runner import BatchEntry

    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40] and bucket_sizes(1) == [1]
    llm = LLM(target, max_num_seqs=4)
    eng, runner = llm.engine, llm.engine.runner
    seqs = [eng.add_request(f"r{i}", list(range(3 + i, 40 + 7 * i)), SamplingParams(max_tokens=8)) for i in range(3)]
    eng.step()  # prefill all three; each now has one token to decode
    graphs = CudaGraphForward(runner.model, runner.kv_caches, runner.inputs, max_batch=4)
    with torch.inference_mode():
        for s in seqs:
            assert eng.block_manager.allocate(s, s.num_tokens)
        step = runner.inputs.build([BatchEntry(s, 1, 1) for s in seqs])
        slots = step.meta.slot_mapping.tolist()
        before = [k.clone() for k, _ in runner.kv_caches]
        want = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
        graphs._pad(3, 4)
        got = runner.model(*graphs.static_args(4))
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    for (k, _), k_before in zip(runner.kv_caches, before):  # only the real tokens' slots were written
        changed = (k != k_before).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert changed == sorted(slots)


def test_native_plans_take_chunks_of_any_length_unless_bounded():
    """A native plan (`paged_attention_cpu`) takes a prefill chunk of any length (the op tiles a
    long chunk's queries, MAX_NATIVE_SCORES is None); bounded (`max_native_scores`, 0 while the
    compiled forward warms its prefill graph up), it takes one while its scores per KV head (heads
    per KV head x queries x context) stay within the bound; past that, or with torch plans past 16
    tokens, the step has no plan and runs the per-sequence path (`write_and_split_attend` when
    compiled)."""
    from pdserve.engine.model_runner import BatchEntry
    from pdserve.engine.sequence import Sequence
    from pdserve.engine.step_inputs import MAX_GATHERED_QUERY_LEN, MAX_NATIVE_SCORES, InputBuffers

    def step(buffers, *chunks):  # (start, num_new_tokens) per sequence
        batch = []
        for i, (start, n) in enumerate(chunks):
            seq = Sequence(f"r{i}", [1] * (start + n), SamplingParams(), seed=0,
                           block_table=list(range(i * 1100, i * 1100 + (start + n + 15) // 16)))
            batch.append(BatchEntry(seq, n, 1, start=start))
        return buffers.build(batch).meta

    group = 2  # heads per KV head
    native = InputBuffers(16, 1100, torch.device("cpu"), plan_on_host=True, native_plans=True, group_size=group)
    torch_plans = InputBuffers(16, 1100, torch.device("cpu"), plan_on_host=True, group_size=group)
    assert MAX_NATIVE_SCORES is None and native.max_native_scores is None
    assert step(native, (0, 8192)).plan is not None and step(native, (8192, 8192), (500, 1)).plan is not None
    assert step(InputBuffers(16, 1100, torch.device("cpu"), plan_on_host=True, native_plans=True,
                             group_size=8 * group), (0, 8192)).plan is not None
    native.max_native_scores = limit = 1 << 21
    per_head = limit // group
    side = int(per_head ** 0.5)
    assert step(native, (0, 100)).plan is not None
    assert step(native, (0, side)).plan is not None and step(native, (0, side + 1)).plan is None
    # a later chunk counts its whole context; decode tokens beside it do not change the verdict
    assert step(native, (500, 1), (0, 100)).plan is not None
    assert step(native, (per_head // 64 - 64, 64)).plan is not None
    assert step(native, (per_head // 64 - 63, 64)).plan is None
    # a model with more heads per KV head takes shorter chunks under the same bound
    more_heads = InputBuffers(16, 1100, torch.device("cpu"), plan_on_host=True, native_plans=True,
                              group_size=4 * group)
    more_heads.max_native_scores = limit
    assert step(more_heads, (0, side)).plan is None
    assert step(torch_plans, (0, MAX_GATHERED_QUERY_LEN)).plan is not None
    assert step(torch_plans, (0, MAX_GATHERED_QUERY_LEN + 1)).plan is None
    native.max_native_scores = 0  # as while the compiled forward warms its prefill graph up
    assert step(native, (0, 100)).plan is None and step(native, (0, 16)).plan is not None

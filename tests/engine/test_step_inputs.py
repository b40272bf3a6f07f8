"""`InputBuffers.build`: each chunk's token ids, positions and cache slots, whichever way they are
written (one token, a short chunk token by token, a long chunk through numpy) and wherever its
tokens come from (the prompt, the outputs, the draft tokens being verified)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import BatchEntry
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_inputs import SHORT_CHUNK, InputBuffers

BLOCK_SIZE = 4


def _seq(req_id: str, prompt_len: int, num_outputs: int, first_block: int) -> Sequence:
    seq = Sequence(req_id, list(range(100, 100 + prompt_len)), SamplingParams(), seed=0,
                   block_table=list(range(first_block + 20, first_block, -1)))  # out of order, as allocated
    seq.output_token_ids = list(range(500, 500 + num_outputs))
    return seq


@pytest.mark.parametrize("start, n, drafts", [
    (20, 1, []),                    # a decode token, the last output
    (20, 5, [7, 8, 9, 10]),         # a verification: the last output, then four drafts
    (17, 5, [7, 8]),                # outputs, then drafts
    (21, 2, [7, 8]),                # drafts only (past the outputs)
    (13, 6, []),                    # a short prefill chunk: prompt into outputs
    (3, SHORT_CHUNK + 4, [7, 8]),   # a long chunk through numpy: prompt, outputs, drafts
])
def test_chunks_carry_their_tokens_positions_and_slots(start, n, drafts):
    seq = _seq("a", prompt_len=16, num_outputs=5, first_block=0)  # tokens 0..20; drafts from 21
    other = _seq("b", prompt_len=3, num_outputs=0, first_block=40)
    inputs = InputBuffers(BLOCK_SIZE, 32, torch.device("cpu"), plan_on_host=False)
    batch = [BatchEntry(other, 3, 1, start=0), BatchEntry(seq, n, 1, start=start, extra_token_ids=drafts)]
    step = inputs.build(batch)
    first = sum(batch[j].num_new_tokens for j in step.order[:step.order.index(1)])  # the entry's first row
    tokens = (seq.token_ids + drafts)[start:start + n]
    assert len(tokens) == n
    positions = list(range(start, start + n))
    slots = [seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    assert step.input_ids[first:first + n].tolist() == tokens
    assert step.positions[first:first + n].tolist() == positions
    assert step.meta.slot_mapping[first:first + n].tolist() == slots


def test_the_input_buffers_are_sized_for_the_step_budget_at_start(checkpoint):
    """Growing the buffers moves the addresses CUDA graphs replay from, so an engine sizes them for
    its scheduler's token budget and batch at once: a full-budget prefill and a full batch move nothing."""
    from pdserve.engine import LLM

    llm = LLM(checkpoint("llama"), max_num_batched_tokens=300, max_num_seqs=20, cpu_attention="torch", cpu_linear="torch")
    inputs = llm.engine.runner.inputs
    generation = inputs.generation
    outs = llm.generate([[3 + (i + j) % 50 for j in range(40)] for i in range(20)],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3] * 20
    assert inputs.generation == generation


@pytest.mark.parametrize("full_width", [False, True])
def test_decode_block_tables_at_full_width_on_request(full_width):
    """On CUDA the decode tables go to the kernel at their full width, as the CUDA graphs read them,
    so an eager step's split-K choice (which reads the width) matches the replay's."""
    inputs = InputBuffers(BLOCK_SIZE, 32, torch.device("cpu"), plan_on_host=False, full_width_decode_tables=full_width)
    seq = _seq("a", prompt_len=40, num_outputs=0, first_block=3)
    step = inputs.build([BatchEntry(seq, 1, 1, start=39)])
    used = len(seq.block_table)  # the widest table in the batch
    assert step.meta.decode_block_tables.shape == (1, 32 if full_width else used)
    assert step.meta.decode_block_tables[0, :used].tolist() == seq.block_table[:used]


def test_a_native_plan_from_the_buffers_is_plan_gathers_over_two_steps():
    """The native plan is written into the runner's buffers (`_native_plan`), not built fresh: the
    same blocks, context lengths and query starts as `plan_gather(..., native=True)`, with tables
    of different lengths, and in a second step whose batch is smaller and narrower than the
    first's. A row's entries past its sequence's blocks may be stale (`paged_attention_cpu` reads
    none of them), so only the blocks each context covers are compared."""
    from pdserve.kernels.gathered_attention import plan_gather

    inputs = InputBuffers(BLOCK_SIZE, 32, torch.device("cpu"), plan_on_host=True, native_plans=True)
    seqs = [_seq("a", prompt_len=16, num_outputs=5, first_block=0),
            _seq("b", prompt_len=30, num_outputs=2, first_block=40), _seq("c", prompt_len=3, num_outputs=0, first_block=80)]
    seqs[2].block_table = [90]  # one block: a shorter row than the others' in the first step
    for batch in ([BatchEntry(seqs[0], 5, 1, start=17, extra_token_ids=[7, 8, 9, 10]),
                   BatchEntry(seqs[1], 1, 1, start=31), BatchEntry(seqs[2], 3, 1, start=0)],
                  [BatchEntry(seqs[2], 2, 1, start=2, extra_token_ids=[7])]):
        step = inputs.build(batch)
        entries = [batch[i] for i in step.order]
        lens, queries = [e.start + e.num_new_tokens for e in entries], [e.num_new_tokens for e in entries]
        width = max(len(e.seq.block_table) for e in entries)
        tables = torch.tensor([e.seq.block_table + [-1] * (width - len(e.seq.block_table)) for e in entries])
        want, got = plan_gather(tables, lens, queries, BLOCK_SIZE, native=True), step.meta.plan
        assert (got.num_seqs, got.max_query_len, got.length) == (want.num_seqs, want.max_query_len, want.length)
        assert got.context_lens.tolist() == want.context_lens.tolist() == lens
        assert got.query_starts.tolist() == want.query_starts.tolist()
        for row, n in enumerate(lens):
            blocks = -(-n // BLOCK_SIZE)
            assert got.block_ids[row, :blocks].tolist() == want.block_ids[row, :blocks].tolist()
            assert got.block_ids.dtype == torch.int64

"""The scheduler without a model: queue membership, computed tokens and free blocks, from
small configs and hand-written runner outputs."""
from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence, SequenceStatus


def seq(i: int, n: int) -> Sequence:
    return Sequence(f"r{i}", list(range(100 * i, 100 * i + n)), SamplingParams(), seed=0, arrival=i)


def run_step(sched: Scheduler, out) -> None:
    """What the engine does after the model ran: advance, and sample a token where a seq is complete."""
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.output_token_ids.append(7)
        sched.block_manager.commit(s.seq)


def test_chunked_prefill_shares_steps_with_decodes():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), BlockManager(32, 4))
    a, b = seq(0, 3), seq(1, 20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 3), (b, 5)]
    run_step(sched, out)
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0 and b.num_computed_tokens == 5
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]  # decode + chunk
    run_step(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]
    run_step(sched, out)
    assert b.num_computed_tokens == 19
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]
    run_step(sched, out)
    assert b.num_output_tokens == 1


def test_queued_prompt_tokens_never_negative_mid_verification():
    """Worker stats read this from another thread, maybe while a speculative step has counted its
    draft tokens as computed and not yet cut back (a negative count failed every GetStats, and
    the router took the worker for unhealthy)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(32, 4))
    a, b = seq(0, 3), seq(1, 20)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    # a's last token and four draft tokens went through the target: counted before the rollback
    a.num_computed_tokens = a.num_tokens + 4
    assert a.num_uncomputed_tokens == -4 and b.num_uncomputed_tokens == 1
    assert sched.num_uncomputed_tokens == 1  # b's, and none of a's


def test_max_num_seqs_and_fcfs():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), BlockManager(32, 4))
    seqs = [seq(i, 4) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert list(sched.waiting) == [seqs[2]]
    run_step(sched, out)
    sched.finish(seqs[0])
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [seqs[1], seqs[2]]


def test_preemption_frees_newest_and_requeues_it_first():
    bm = BlockManager(4, 4)  # 16 slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), bm)
    a, b = seq(0, 8), seq(1, 8)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # a needs a 3rd block for its decode token: b must go
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and b.num_tokens == 9  # its generated token is kept
    run_step(sched, out)
    sched.finish(a)
    assert bm.num_free_blocks == 4
    out = sched.schedule()
    # recompute prompt + output, minus its first block, still in the prefix cache
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 5)]
    assert b.num_cached_tokens == 4


def test_budget_leaves_running_seqs_waiting_their_turn():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2), BlockManager(32, 4))
    seqs = [seq(i, 1) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    run_step(sched, out)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]  # running first; the third still waits
    assert list(sched.waiting) == [seqs[2]]


def test_finish_frees_blocks_and_is_idempotent():
    bm = BlockManager(8, 4)
    sched = Scheduler(SchedulerConfig(), bm)
    a = seq(0, 10)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.finish(a)
    sched.finish(a)
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()


def test_prefill_chunk_tokens_caps_prompt_tokens_only_in_steps_that_decode():
    """A decode worker's cap: prompt chunks (a running prompt's and a new one's) share at most
    `prefill_chunk_tokens` in a step that decodes; a step that decodes nothing takes the budget."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_tokens=6),
                      BlockManager(64, 4))
    a = seq(0, 20)
    sched.add(a)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 20)]  # nothing decodes: no cap
    run_step(sched, out)
    b, c = seq(1, 10), seq(2, 5)
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 6)]  # c waits: the cap is spent
    run_step(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 4), (c, 2)]
    run_step(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (c, 3)]
    run_step(sched, out)
    assert [s.num_output_tokens for s in (a, b, c)] == [4, 2, 1]
    assert sched.running == [a, b, c]  # the order of arrival kept while c's chunks waited


def test_a_prompt_chunk_over_the_cap_waits_in_its_place():
    """Two activated prompts (a decode worker's local prefills) past the cap: the second is left
    for a later step and keeps its place in the running queue."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_tokens=4),
                      BlockManager(64, 4))
    a, b, c = seq(0, 1), seq(1, 6), seq(2, 6)
    sched.add(a)
    run_step(sched, sched.schedule())
    for s in (b, c):
        assert sched.reserve(s, s.num_tokens)
        sched.activate(s)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 4)]
    assert sched.running == [a, b, c]
    run_step(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 2), (c, 2)]
    assert sched.running == [a, b, c]
    SchedulerConfig(prefill_chunk_tokens=0)  # 0: no cap
    try:
        SchedulerConfig(prefill_chunk_tokens=-1)
    except ValueError as e:
        assert "prefill_chunk_tokens" in str(e)
    else:
        raise AssertionError("a negative cap was taken")


def test_a_sequences_own_chunk_cap_holds_only_in_steps_that_decode():
    """`Sequence.chunk_tokens` (a decode worker's local tail): at most that many prompt tokens in a
    step that decodes; alone, the step's budget."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 4))
    a, b = seq(0, 2), seq(1, 20)
    b.chunk_tokens = 5
    assert sched.reserve(b, b.num_tokens)
    sched.activate(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 20)]  # nothing decodes: no cap
    sched.finish(b)
    c = seq(2, 20)
    c.chunk_tokens = 5
    sched.add(a)
    run_step(sched, sched.schedule())
    assert sched.reserve(c, c.num_tokens)
    sched.activate(c)
    for want in (5, 5, 5, 5):
        out = sched.schedule()
        assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (c, want)]
        run_step(sched, out)
    assert c.num_output_tokens == 1


def test_tails_with_their_own_cap_share_it_in_a_step():
    """Several local tails at once (a decode worker's turns arriving together) take the cap in all,
    the oldest first, so the step's prompt tokens stay bounded however many arrive."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 4))
    a, b, c = seq(0, 2), seq(1, 7), seq(2, 7)
    sched.add(a)
    run_step(sched, sched.schedule())
    for s in (b, c):
        s.chunk_tokens = 5
        assert sched.reserve(s, s.num_tokens)
        sched.activate(s)
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append([(s.seq.req_id, s.num_new_tokens) for s in out.scheduled])
        run_step(sched, out)
    assert steps == [[("r0", 1), ("r1", 5)], [("r0", 1), ("r1", 2), ("r2", 3)], [("r0", 1), ("r1", 1), ("r2", 4)]]

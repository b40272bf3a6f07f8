"""Draft-model proposals: a small model with the target's tokenizer runs k steps
autoregressively, batched across sequences.

The draft has its own KV tensors but shares the target's block tables: block b holds the
target's K/V in the target cache and the draft's K/V in the draft cache. Each sequence tracks
`num_draft_computed_tokens`; the first proposal step catches the draft up on whatever it has
not seen (a fresh prompt, the last step's accepted and bonus tokens) in one pass. In steady
decoding every pass of a proposal runs as a graph (`ModelRunner.draft_passes`), the catch-up
included.

A sampled request's draft tokens are drawn by the same exponential race as every other token,
with the noise the verifier asks for: the target's own (seed, position) noise for the coupled
verifier, a separate stream for the rejection sampler, which also needs q, the distributions
the tokens were drawn from. For the coupled verifier, passes run at once hand their noise rows on
with the proposal (`Proposal.noise`): it draws those positions with the same rows.
"""
from __future__ import annotations

import time

import torch

from pdserve.engine import rng
from pdserve.engine.model_runner import BatchEntry, ModelRunner
from pdserve.engine.sampler import Sampler, race_noise
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.costs import LinearCost
from pdserve.engine.spec_decode.proposer import Proposal
from pdserve.kernels import argmax_rows, race_ref


class DraftProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler, cost: LinearCost | None, noise_stream: int,
                 keep_probs: bool):
        """cost: the draft's cost line, which each proposal's passes feed (None: a fixed depth,
        which reads none)."""
        self.runner, self.sampler, self.cost = runner, sampler, cost
        self.noise_stream, self.keep_probs = noise_stream, keep_probs
        # False: the catch-up pass always runs through `execute`, and only the passes after it
        # at once (`benchmarks/draft_passes.py` measures the two side by side)
        self.catch_up_at_once = True
        self._fresh = [0.0, 0]  # since `take_catch_up`: seconds and tokens of catching up on fresh prompts

    def take_catch_up(self) -> tuple[float, int]:
        """Seconds the draft spent catching up on fresh prompts (sequences it has not drafted for
        yet, past any cached prefix) beyond what an ordinary pass costs, and the tokens it caught
        up on, since the last call. A cost of speculating on those requests that no decode step
        shows: the gate spreads it over their tokens (`SpeculationGate.observe_catch_up`)."""
        out, self._fresh = (self._fresh[0], self._fresh[1]), [0.0, 0]
        return out

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Per sequence: draft tokens and, when kept, their distributions q [k, vocab_size]."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        noise: list[torch.Tensor | None] = [None] * len(seqs)
        if active and self.catch_up_at_once and self._run_at_once(seqs, active, ks, tokens, catch_up=True, noise=noise,
                                                                  probs=probs):
            return [Proposal(t, torch.stack(p) if p else None, n) for t, p, n in zip(tokens, probs, noise)]
        entries = [BatchEntry(seqs[i], seqs[i].num_tokens - seqs[i].num_draft_computed_tokens, 1,
                              start=seqs[i].num_draft_computed_tokens) for i in active]
        step = 0
        # tokens to catch up on of sequences whose prompt the draft has not seen (fresh ones),
        # counted where the gate reads them (adaptive depth)
        fresh = 0 if self.cost is None else sum(
            e.num_new_tokens for e in entries if e.start < e.seq.num_prompt_tokens and e.num_new_tokens > 2)
        # an ordinary pass's seconds, predicted before the catch-up's own pass moves the line
        ordinary = self.cost(len(entries)) if fresh and not self.cost.is_guess else 0.0
        while active:
            start = time.perf_counter()
            picks, q = self._run(entries, [seqs[i] for i in active], step)
            if fresh and step == 0:
                self._fresh[0] += max(time.perf_counter() - start - ordinary, 0.0)
                self._fresh[1] += fresh
            for row, i in enumerate(active):
                seqs[i].num_draft_computed_tokens = entries[row].start + entries[row].num_new_tokens
                tokens[i].append(picks[row])
                if q is not None and not seqs[i].params.is_greedy:  # a greedy request's q is never read
                    probs[i].append(q[row])
            step += 1
            active = [i for i in active if ks[i] > step]
            if step == 1 and active and self._run_at_once(seqs, active, ks, tokens, catch_up=False, probs=probs):
                break
            entries = [BatchEntry(seqs[i], 1, 1, start=seqs[i].num_tokens + step - 1, extra_token_ids=tokens[i])
                       for i in active]
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _run_at_once(self, seqs: list[Sequence], active: list[int], ks: list[int], tokens: list[list[int]],
                     catch_up: bool, noise: list | None = None, probs: list | None = None) -> bool:
        """The draft's passes as one call (`ModelRunner.draft_passes`) when every sequence still
        drafting is greedy or samples by temperature alone; False when not, or the runner cannot.
        Where q is kept (the rejection sampler's), the passes hand back the logits they picked from,
        and each sampled row's q, the sampler's distribution of them as `_run` makes it
        (`Sampler.probs`), goes to `probs`; through the native passes only (elsewhere False). Pass
        by pass, a rejection step cost 2.3x a coupled one at batch 1, temperature 1 (b0c83da,
        scratch profile); the fused step now takes most of its steps. Sequences of mixed depths
        (adaptive depth trims each to the positions worth verifying) all run to the deepest, where
        every block table already holds those slots, and each keeps its own depth's tokens: the
        passes' cost is mostly fixed, and pass by pass through `execute` and the sampler, the
        catch-up alone cost about two passes at once (at batch 8, temperature 1 on the demo pair, a
        scratch trace had mixed depths in 8 to 18% of the steps). The extra K/V lie beyond what
        verification can accept, as a rejected draft's do, and go the same way
        (`Speculator.rollback`). With catch_up, every pass of the proposal, the first catching the
        draft up on the sequence's last two tokens, where none has more than two tokens the draft
        has not seen (after a verification, one or two; a fresh prompt, or a sequence back from
        plain steps, catches up pass by pass); without, the passes after the first. A sampled pass
        races the same noise as `_run` would draw (the stream, seed and position of the token it
        picks); with `noise` (a list per sequence), each drafting sequence's rows [k, vocab_size] go
        there for its proposal."""
        depth = max(ks[i] for i in active)
        group = [seqs[i] for i in active]
        params = [s.params for s in group]
        if not all(p.is_greedy or p.filters_by_temperature_only for p in params):
            return False
        keep = self.keep_probs and not all(p.is_greedy for p in params)
        if catch_up:
            if any(not 1 <= s.num_tokens - s.num_draft_computed_tokens <= 2 or s.num_tokens < 2 for s in group):
                return False
            first, num_passes = 0, depth  # pass j picks the token at num_tokens + j
            previous, last_ids = map(list, zip(*(s.last_token_ids(2) for s in group)))
            positions = [s.num_tokens - 1 for s in group]
        else:
            first, num_passes = 1, depth - 1
            last_ids, previous = [tokens[i][-1] for i in active], None
            positions = [s.num_tokens for s in group]
        if not self.runner.can_draft_passes(group, positions, num_passes):
            return False
        start = time.perf_counter()
        temperatures = races = None
        if not all(p.is_greedy for p in params):
            temperatures = [0.0 if p.is_greedy else float(p.temperature) for p in params]
            picked_at = [s.num_tokens + j for j in range(first, depth) for s in group]
            races = race_noise(params * num_passes, [s.seed for s in group] * num_passes, picked_at,
                               self.runner.cfg.vocab_size, self.noise_stream, self.runner.device,
                               self.sampler.hash_fn).view(num_passes, len(active), -1)
        picks = self.runner.draft_passes(group, last_ids, positions, num_passes, temperatures, races, previous,
                                         keep_logits=keep)
        if picks is None:
            return False
        if keep:  # q of every pass's rows, as `_run` filters them, by sequence: [len(active), num_passes, vocab]
            picks, logits = picks  # logits [num_passes, len(active), vocab_size]
            q = self.sampler.probs(logits.reshape(-1, logits.shape[-1]), params * num_passes)
            q = q.view(num_passes, len(active), -1).transpose(0, 1)
        for row, (i, more) in enumerate(zip(active, picks)):
            tokens[i].extend(more[:ks[i] - first])  # its own depth
            if keep and not params[row].is_greedy:  # a greedy request's q is never read
                probs[i].extend(q[row, :ks[i] - first])
            seqs[i].num_draft_computed_tokens = seqs[i].num_tokens + depth - 1
            if noise is not None and races is not None and not first and self.noise_stream == rng.SAMPLE_STREAM:
                noise[i] = races[:ks[i], row]
        self.observe_passes(len(active), time.perf_counter() - start, num_passes)
        return True

    def observe_passes(self, num_seqs: int, seconds: float, num_passes: int) -> None:
        """num_passes passes of num_seqs sequences at once took `seconds`: the cost line's points."""
        if self.cost is not None:
            self.cost.observe(num_seqs, seconds / num_passes, count=num_passes)

    def _run(self, entries: list[BatchEntry], seqs: list[Sequence], step: int) -> tuple[list[int], torch.Tensor | None]:
        """One draft forward: the picked tokens and, when kept, their distributions q
        [len(seqs), vocab_size] (None when every row is greedy: q is one-hot on the pick)."""
        start = time.perf_counter()
        logits = self.runner.execute(entries)
        params, seeds = [s.params for s in seqs], [s.seed for s in seqs]
        positions = [s.num_tokens + step for s in seqs]
        q = None
        if all(p.is_greedy for p in params):
            picks = argmax_rows(logits)
        elif self.keep_probs:
            q = self.sampler.probs(logits, params)
            picks = race_ref(q, race_noise(params, seeds, positions, logits.shape[-1], self.noise_stream, q.device,
                                         self.sampler.hash_fn))
        else:
            picks = self.sampler.sample_tensor(logits, params, seeds, positions, self.noise_stream)
        picks = picks.tolist()
        # the line prices the plan's passes (a token a sequence, or two catching up after a
        # verification); a catch-up over a fresh prompt or past plain steps is one forward over
        # many tokens, far cheaper a token, and reaches the gate apart (`propose`'s `_fresh`)
        if self.cost is not None and all(e.num_new_tokens <= 2 for e in entries):
            self.cost.observe(sum(e.num_new_tokens for e in entries), time.perf_counter() - start)
        return picks, q

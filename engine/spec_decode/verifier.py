"""The two verifiers the engine can run, behind one call: `verify(seqs, proposals, rows)`.

- `CoupledVerifier` (`coupled.py`): the target samples every verified position exactly as plain
  sampling would (the same `Sampler`, the same (seed, position) noise) and the drafts are kept
  while they match. Tokens are a function of (seed, position) alone.
- `RejectionVerifier` (`rejection_sampler.py`): accept x with probability min(1, p(x)/q(x)),
  recover from norm(max(0, p - q)). Distribution-exact, accepts more, but which tokens come out
  depends on the draft and the depth.

Both run the whole batch at once, with one host copy of the results: the coupled verifier
draws every row in one call and matches the drafts against the draws on the host
(`verify_greedy`'s rule: keep drafts while they equal the target's token, then emit the
target's token); the rejection sampler runs its rule for every sequence in one native call where
the rows race natively (`pdserve::rejection_rows`, on the CPU, for rows sampled by temperature
alone), and elsewhere pads every sequence's rows to the deepest proposal and tests them together
in torch (`rejection_sampler.verify_batch`, the same rule on the same draws). A batch of only
greedy requests takes the argmax and needs neither distributions nor noise; both verifiers then
agree with `verify_greedy`. A step the fused step covers (`fused_step.py`) runs either verifier's
rule inside its one native call and never reaches these.
"""
from __future__ import annotations

import torch

from pdserve.engine import rng
from pdserve.engine.sampler import Sampler, race_noise, stack_rows
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.proposer import Proposal
from pdserve.engine.spec_decode.rejection_sampler import verify_batch, verify_greedy
from pdserve.kernels import argmax_rows

SPEC_VERIFIERS = ("coupled", "rejection")


class _Verifier:
    name = ""
    draft_stream = rng.SAMPLE_STREAM  # the noise a draft samples with
    needs_draft_probs = False  # whether proposals must carry q

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def verify(self, seqs: list[Sequence], proposals: list[Proposal], rows: list[torch.Tensor]) -> list[list[int]]:
        """rows[b]: the target's logits [k_b + 1, vocab_size] at seqs[b]'s last token and each
        draft token. Returns each sequence's emitted tokens (accepted drafts + one)."""
        if all(s.params.is_greedy for s in seqs):
            return _match(argmax_rows(stack_rows(rows)).tolist(), proposals)
        return self._verify_sampled(seqs, proposals, rows)

    def _verify_sampled(self, seqs, proposals, rows) -> list[list[int]]:
        raise NotImplementedError


class CoupledVerifier(_Verifier):
    name = "coupled"

    def _verify_sampled(self, seqs, proposals, rows) -> list[list[int]]:
        params, seeds, positions = _per_row(seqs, rows)
        logits = stack_rows(rows)
        noise = self._noise(proposals, rows, params, seeds, positions, logits.device)
        picks = self.sampler.sample_tensor(logits, params, seeds, positions, noise=noise)  # plain sampling's draws
        return _match(picks.tolist(), proposals)

    def _noise(self, proposals, rows, params, seeds, positions, device) -> torch.Tensor | None:
        """Every verified row's exponentials, the draft tokens' taken from the proposals that
        kept the rows the draft raced (the same stream, seed and position), the rest hashed;
        None where no proposal kept any (the sampler then hashes them all). A step at batch 8,
        temperature 1, depth 2 hashed 24 rows where 8 are new (each row of 4096 about 4.6 µs,
        one thread, Intel Xeon; scratch timing)."""
        if not any(p.noise is not None for p in proposals):
            return None
        fresh, slices, start = [], [], 0  # rows to hash; (row, kept rows or None) per proposal
        for prop, r in zip(proposals, rows):
            kept = prop.noise if prop.noise is not None and len(prop.noise) == len(r) - 1 else None
            fresh += range(start + (0 if kept is None else len(kept)), start + len(r))
            slices.append((start, kept))
            start += len(r)
        hashed = race_noise([params[i] for i in fresh], [seeds[i] for i in fresh], [positions[i] for i in fresh],
                            rows[0].shape[-1], rng.SAMPLE_STREAM, device, self.sampler.hash_fn)
        out = torch.empty(start, rows[0].shape[-1], device=device)
        out[torch.tensor(fresh, device=device)] = hashed
        for begin, kept in slices:
            if kept is not None:
                out[begin:begin + len(kept)] = kept
        return out


class RejectionVerifier(_Verifier):
    name = "rejection"
    draft_stream = rng.DRAFT_STREAM
    needs_draft_probs = True

    def _verify_sampled(self, seqs, proposals, rows) -> list[list[int]]:
        """Rows that race natively (greedy or by temperature alone, on the CPU) through the native
        rule, the rest through `verify_batch`: a sequence's tokens never depend on what else the
        batch holds."""
        native = self.sampler.native_rows([s.params for s in seqs])
        if len(native) == len(seqs):
            return self._verify_native(seqs, proposals, rows)
        rest = sorted(set(range(len(seqs))) - set(native))
        out: list[list[int]] = [[] for _ in seqs]
        for group, verify in ((native, self._verify_native), (rest, self._verify_torch)):
            if group:
                for i, tokens in zip(group, verify([seqs[i] for i in group], [proposals[i] for i in group],
                                                   [rows[i] for i in group])):
                    out[i] = tokens
        return out

    def _verify_native(self, seqs, proposals, rows) -> list[list[int]]:
        """`pdserve::rejection_rows` over p and q as the native races make them (`Sampler.probs`;
        a proposal without q, an n-gram's, is one-hot on its tokens): the rule of `verify_batch`,
        with the same draws, in one call (`cpu/rejection.cpp`)."""
        params, _, _ = _per_row(seqs, rows)
        vocab = rows[0].shape[-1]
        p = self.sampler.probs(stack_rows(rows), params)
        qs = [prop.probs if prop.probs is not None else _draft_probs(prop, len(prop.token_ids), vocab, p.device)
              for prop in proposals if prop.token_ids]
        q = torch.cat(qs).float() if qs else p.new_empty(0, vocab)
        accepted, last = torch.ops.pdserve.rejection_rows(
            p, q, torch.tensor([t for prop in proposals for t in prop.token_ids], dtype=torch.int64),
            torch.tensor([len(prop.token_ids) for prop in proposals]), rng.seed_words([s.seed for s in seqs]),
            torch.tensor([s.num_tokens for s in seqs]),
            torch.tensor([float(s.params.temperature) for s in seqs]),
            rng.vocab_codes(vocab))
        return [prop.token_ids[:a] + [t] for prop, a, t in zip(proposals, accepted.tolist(), last.tolist())]

    def _verify_torch(self, seqs, proposals, rows) -> list[list[int]]:
        drafts, num_drafts = _draft_ids(proposals, rows[0].device)
        params, _, _ = _per_row(seqs, rows)
        vocab, max_k = rows[0].shape[-1], drafts.shape[1]
        p = self.sampler.ops.filter_probs(stack_rows(rows), *self.sampler.tensors.build(params))
        p = _pad_rows(list(p.split([len(r) for r in rows])), max_k + 1)
        q = torch.stack([_draft_probs(prop, max_k, vocab, p.device) for prop in proposals])
        u = torch.tensor([[rng.uniform(s.seed, s.num_tokens + i, rng.ACCEPT_STREAM) for i in range(max_k)] for s in seqs],
                         dtype=torch.float64, device=p.device)

        def last_noise(accepted: list[int]) -> torch.Tensor:  # the bonus draws as plain sampling would
            streams = [rng.SAMPLE_STREAM if n == len(prop.token_ids) else rng.RESIDUAL_STREAM
                       for n, prop in zip(accepted, proposals)]
            return race_noise([s.params for s in seqs], [s.seed for s in seqs],
                              [s.num_tokens + n for s, n in zip(seqs, accepted)], vocab, streams, p.device,
                              self.sampler.hash_fn)

        return verify_batch(p, q, drafts, num_drafts, u, last_noise)


def build_verifier(name: str, sampler: Sampler) -> _Verifier:
    if name not in SPEC_VERIFIERS:
        raise ValueError(f"spec_verifier must be one of {SPEC_VERIFIERS}, got {name!r}")
    return CoupledVerifier(sampler) if name == "coupled" else RejectionVerifier(sampler)


def _match(picks: list[int], proposals: list[Proposal]) -> list[list[int]]:
    """Split the target's token at every verified row among the sequences and keep, per
    sequence, the drafts that equal it (`coupled.emit_matching` on the host)."""
    out, i = [], 0
    for prop in proposals:
        k = len(prop.token_ids)
        out.append(verify_greedy(picks[i:i + k + 1], prop.token_ids))
        i += k + 1
    return out


def _draft_ids(proposals: list[Proposal], device) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, max_k] draft ids padded with 0, and [batch] each k."""
    max_k = max(len(p.token_ids) for p in proposals)
    ids = torch.tensor([p.token_ids + [0] * (max_k - len(p.token_ids)) for p in proposals], dtype=torch.int64)
    num = torch.tensor([len(p.token_ids) for p in proposals], dtype=torch.int64)
    return ids.to(device), num.to(device)


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[batch, width, vocab_size]: each sequence's rows, the last one repeated as padding."""
    index = [min(i, len(r) - 1) for r in rows for i in range(width)]
    starts = torch.tensor([0] + [len(r) for r in rows[:-1]]).cumsum(0).repeat_interleave(width)
    flat = torch.cat(rows)
    return flat[(starts + torch.tensor(index)).to(flat.device)].view(len(rows), width, -1)


def _per_row(seqs: list[Sequence], rows: list[torch.Tensor]) -> tuple[list, list[int], list[int]]:
    """Each verified row's params, seed and the position of the token it predicts."""
    params, seeds, positions = [], [], []
    for s, r in zip(seqs, rows):
        params += [s.params] * len(r)
        seeds += [s.seed] * len(r)
        positions += range(s.num_tokens, s.num_tokens + len(r))
    return params, seeds, positions


def _draft_probs(prop: Proposal, max_k: int, vocab: int, device) -> torch.Tensor:
    """[max_k, vocab_size]: q of each draft token, one-hot where the proposer gave none."""
    q = torch.zeros(max_k, vocab, device=device)
    k = len(prop.token_ids)
    if prop.probs is not None:
        q[:k] = prop.probs.to(device)
    else:
        q[torch.arange(k), torch.tensor(prop.token_ids, dtype=torch.long)] = 1.0
    return q

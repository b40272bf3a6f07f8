"""`DraftPasses`: a draft model's proposal passes, each pass's pick the next pass's input, run
as one call per pass with nothing built on the host between them: one native call for all the
passes where the native CPU ops run the model (`native_forward.NativePasses`), else one
`torch.compile` graph per kind of pass, called straight once compiled (`capture._KeptGraph`),
else eagerly. `ModelRunner.draft_passes` builds their state; `spec_decode/draft.py` uses them.
"""
from __future__ import annotations

import logging
import types

import torch

from pdserve.engine.capture import _INDUCTOR_PASS_OPTIONS, _KeptGraph, _guard_step_inputs_only, _own_function
from pdserve.engine.model.llama import AttentionMetadata
from pdserve.engine.native_forward import NativePasses
from pdserve.kernels.gathered_attention import GatherPlan
from pdserve.kernels.sampling import race_ref

log = logging.getLogger(__name__)


class DraftPasses:
    """A draft model's passes: pass j's pick is pass j + 1's input token, at the next position,
    with nothing built on the host in between. A greedy row picks the argmax; a sampled row
    (temperature only: no top-k, top-p or min-p) races its softmax against the exponentials it
    is given for that pass, as `Sampler` would (`kernels/sampling.py`).

    The first pass can be a catch-up: each sequence's last two tokens go in together (the one
    before the last has its K/V written again, the same values where the draft held them), which
    covers both ways a verification ends, with the last draft and the bonus token new to the draft
    or with only the token that replaced a rejected draft new. A step's whole proposal is then
    one call per pass, nothing built on the host. Through `ModelRunner.execute` and the sampler,
    the catch-up pass cost about twice a later pass (about 2.2 ms against 1.1 ms on the Xeon).

    The draft's passes are the same few hundred microseconds of fixed cost each, whatever the
    batch: on the demo pair a pass cost about 0.19 of a target step, and building its step's
    inputs and the logits' separate call were half of it. Here a pass is one call of one graph
    (with `compile`) that takes a small state tensor (each sequence's tokens, position and block
    ids), works out its slots and lengths itself, runs the model and the pick, and returns the
    next state: about 0.21 ms a pass on the demo draft against 0.46 ms (AMD EPYC, batch 1). The
    passes unrolled into one graph per pass count ran 0.15 ms a pass, but took 21 s to compile the
    three counts a depth of 4 needs, against 7 s for this one graph. A batch that samples runs
    other graphs (the pick differs), which also take the place of the sampler's separate noise,
    filter and race calls per pass: at batch 1, temperature 1, those cost about 0.17 ms a pass.
    Four graphs in all: greedy or sampled, catch-up or not. Once compiled, each is called
    straight, not through Dynamo (`_KeptGraph`): a third of a pass was Dynamo's.

    Needs the native attention (its plans are block ids, lengths and query starts, which a pass
    can compute) and every sequence's block table to hold the slots of the tokens to come (the
    scheduler reserves them for the verification)."""

    KINDS = ("greedy", "sampled", "greedy catch-up", "sampled catch-up")

    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, compiled: bool,
                 native: bool = False):
        """native: run every pass through `NativePasses` where the model allows (projections
        packed, float32): then nothing is compiled, and the eager passes below are only the
        reference the native ones are tested against."""
        self.kv_caches, self.block_size = kv_caches, block_size
        self._eager = {kind: types.MethodType(fn, model) for kind, fn in zip(self.KINDS, _PASSES)}
        self._fns = dict(self._eager)
        self._graphs: dict[str, _KeptGraph] = {}
        self.native = NativePasses.of(model, kv_caches) if native else None
        if compiled and self.native is None:  # code objects of their own, so the guards dropped are only this model's
            for kind, fn in zip(self.KINDS, _PASSES):
                self._graphs[kind] = _KeptGraph(_INDUCTOR_PASS_OPTIONS)
                self._fns[kind] = torch.compile(types.MethodType(_own_function(fn), model), fullgraph=True,
                                                dynamic=False, backend=self._graphs[kind],
                                                options={"guard_filter_fn": _guard_step_inputs_only})
        self.is_broken = False  # compiling failed once: eager from then on

    def __call__(self, state: torch.Tensor, num_passes: int, temperature: torch.Tensor | None = None,
                 noise: torch.Tensor | None = None, catch_up: bool = False) -> torch.Tensor:
        """state [num_seqs, 2 + num_blocks] int64: each sequence's input token, its position, then
        its block ids; with catch_up, [num_seqs, 3 + num_blocks]: the token before the input token
        (at the position before), the input token, its position, the block ids. temperature
        [num_seqs] float32 (0: greedy) and noise [num_passes, num_seqs, vocab_size] Exp(1) draws,
        when any sequence samples; None when every one is greedy. The picks [num_passes, num_seqs]."""
        if self.native is not None:
            return self.native(state, num_passes, temperature, noise, catch_up)
        picks = []
        for j in range(num_passes):
            kind = ("greedy" if temperature is None else "sampled") + (" catch-up" if catch_up and j == 0 else "")
            state = self._pass(kind, state) if temperature is None else self._pass(kind, state, temperature, noise[j])
            picks.append(state[:, 0])
        return torch.stack(picks)

    def with_logits(self, state: torch.Tensor, num_passes: int, temperature: torch.Tensor | None = None,
                    noise: torch.Tensor | None = None,
                    catch_up: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`__call__`'s picks and the logits each pass picked from [num_passes, num_seqs,
        vocab_size] (what the rejection sampler's q comes from): through the native passes only;
        None elsewhere, and the caller runs its passes one by one."""
        return None if self.native is None else self.native.with_logits(state, num_passes, temperature, noise, catch_up)

    def compiled(self, kind: str):
        """The compiled function of one of `KINDS` (None when eager)."""
        fn = self._fns[kind]
        return None if fn is self._eager[kind] else fn

    def calls_straight(self, kind: str) -> bool:
        """Whether a pass of this kind calls its compiled graph without Dynamo (`_KeptGraph`)."""
        return self.compiled(kind) is not None and self._graphs[kind].call is not None

    def _pass(self, kind: str, state: torch.Tensor, *sampling: torch.Tensor) -> torch.Tensor:
        fn = self._fns[kind]
        if fn is self._eager[kind]:
            return fn(state, *sampling, self.kv_caches, self.block_size)
        graph = self._graphs[kind]
        try:
            if graph.call is not None:  # compiled: straight to the graph
                return graph.call(dict(zip(("state", "temperature", "noise"), (state, *sampling))))
            for dim in (0, 1):  # one graph each, whatever the batch and the table width
                torch._dynamo.decorators.mark_unbacked(state, dim)
            for t in sampling:
                torch._dynamo.decorators.mark_unbacked(t, 0)
            return fn(state, *sampling, self.kv_caches, self.block_size)
        except Exception as e:  # compilation failed: say so once and stay eager
            self.is_broken, self._fns = True, dict(self._eager)
            log.warning("graph capture (compile) of the draft's passes failed, running eagerly: %r", e)
            return self._eager[kind](state, *sampling, self.kv_caches, self.block_size)


def _pass_logits(model, state: torch.Tensor, num_query: int, kv_caches: list, block_size: int) -> torch.Tensor:
    """A pass's forward: each sequence's last num_query tokens (state's first columns) at the
    positions up to its position (the next column), K/V written by its block ids (the rest); the
    logits at each sequence's last token [num_seqs, vocab_size]."""
    num_seqs = state.shape[0]
    ids, last, block_ids = state[:, :num_query], state[:, num_query], state[:, num_query + 1:]
    positions = last.unsqueeze(1) + torch.arange(1 - num_query, 1, dtype=torch.int64, device=state.device)
    blocks = block_ids.gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    plan = GatherPlan(block_ids, num_seqs, num_query, 0, None, None, None, [], context_lens=last + 1,
                      query_starts=torch.arange(num_seqs + 1, dtype=torch.int64, device=state.device) * num_query)
    unused = state.new_empty((0,), dtype=torch.int32)
    meta = AttentionMetadata((blocks * block_size + positions % block_size).reshape(-1), num_seqs * num_query,
                             unused.view(0, 0), unused, unused.view(0, 0), unused, unused, plan)
    hidden = model.forward(ids.reshape(-1), positions.reshape(-1), kv_caches, meta)
    if num_query > 1:
        hidden = hidden.view(num_seqs, num_query, -1)[:, -1]
    return model.compute_logits(hidden)


def _next_state(state: torch.Tensor, num_query: int, picks: torch.Tensor) -> torch.Tensor:
    """Each sequence's pick, the position after, the same block ids."""
    return torch.cat([picks.unsqueeze(1), (state[:, num_query] + 1).unsqueeze(1), state[:, num_query + 1:]], dim=1)


def _race(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A greedy row (temperature 0) takes the argmax, a sampled row the exponential race over its
    softmax at its temperature (`sample_ref` with top-k, top-p and min-p off)."""
    greedy = temperature <= 0
    probs = (logits / torch.where(greedy, 1.0, temperature)[:, None]).softmax(-1)
    return torch.where(greedy, logits.argmax(-1), race_ref(probs, noise))


# `DraftPasses`' passes, one function (and so one graph) per kind; `self` is the model (so its
# guards are among those dropped).
def _greedy_pass(self, state: torch.Tensor, kv_caches: list, block_size: int) -> torch.Tensor:
    return _next_state(state, 1, _pass_logits(self, state, 1, kv_caches, block_size).argmax(-1))


def _sampled_pass(self, state: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor, kv_caches: list,
                  block_size: int) -> torch.Tensor:
    return _next_state(state, 1, _race(_pass_logits(self, state, 1, kv_caches, block_size), temperature, noise))


def _greedy_catch_up(self, state: torch.Tensor, kv_caches: list, block_size: int) -> torch.Tensor:
    return _next_state(state, 2, _pass_logits(self, state, 2, kv_caches, block_size).argmax(-1))


def _sampled_catch_up(self, state: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor, kv_caches: list,
                      block_size: int) -> torch.Tensor:
    return _next_state(state, 2, _race(_pass_logits(self, state, 2, kv_caches, block_size), temperature, noise))


_PASSES = (_greedy_pass, _sampled_pass, _greedy_catch_up, _sampled_catch_up)  # in `DraftPasses.KINDS`' order

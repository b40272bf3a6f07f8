"""Graph capture: a step's forward pass run as one captured unit instead of op by op.

At batch 1 a decode step of a small model is mostly per-op overhead (FACTS.md: ~7x the time to
stream the weights once), so running the whole forward as one captured graph is where most of
what is left goes. Two captures, one interface (`covers`, `__call__`, `warm_up`):

- **compile** (CPU): `torch.compile` (Inductor) of the model's forward, whatever a step's batch
  size or lengths: the K/V write and the attention are one opaque op (`write_and_attend` for steps
  planned by a `GatherPlan`: decode, speculative verification, a draft's passes;
  `write_and_split_attend` for steps with prefill chunks), and every size a step varies in is
  marked unbacked, so two graphs serve every step and nothing recompiles as contexts grow. Once
  compiled, a planned step calls its graph straight, without Dynamo (`_KeptGraph`); steps with
  prefill chunks go through Dynamo. Steps that stream K/V layer by layer (a prefill worker's) run
  eagerly.
- **cuda_graphs** (CUDA): one CUDA graph per batch-size bucket of decode-only steps, replayed from
  static input buffers (`cuda_graphs.py`).

Beside them, with the native CPU ops (projections packed, float32), two natives that need no
capture (`native_forward.py`): a step with a native attention plan (decode, verification, prefill
chunks of any length) is one call of `pdserve::decoder_forward` (`NativeForward`), and a draft's
passes one call of `pdserve::draft_passes` (`NativePasses`), whatever `graph_capture` says (a
step that streams K/V layer by layer, a prefill worker's, one call per layer); the capture then
takes the steps of a model the natives cannot run (projections not packed, not float32).

A draft's passes have captures of their own, in `draft_passes.py` (`DraftPasses`).

A capture never changes what a step computes, only how: it runs the same model code on the same
inputs. It may round differently (Inductor fuses elementwise ops and reorders sums, about 1e-6
relative in float32), so tests check that greedy tokens are the same with and without it.
"""
from __future__ import annotations

import logging
import operator
import re
import time
import types

import torch

from pdserve.engine.step_inputs import StepInputs

log = logging.getLogger(__name__)

GRAPH_CAPTURES = ("auto", "off", "compile", "cuda_graphs")


def resolve_capture(name: str, device: torch.device, kernels: str) -> str:
    """"auto": CUDA graphs on CUDA with the Triton kernels; off on the CPU, where compiling
    takes tens of seconds per model (ask for "compile" where a process lives long enough to earn
    it back). CUDA graphs need the Triton kernels: the torch references read lengths on the host."""
    if name == "auto":
        return "cuda_graphs" if device.type == "cuda" and kernels == "triton" else "off"
    if name == "cuda_graphs" and (device.type != "cuda" or kernels != "triton"):
        raise ValueError("graph_capture='cuda_graphs' needs a CUDA device and the Triton kernels")
    return name


class CompiledForward:
    """`torch.compile` of `model.forward` for steps planned by a uniform `GatherPlan`, and (with
    `prefill`) for steps with prefill chunks: one graph each. A planned step calls its graph
    straight once it is compiled (`_KeptGraphs`, keyed by `kind`): Dynamo's frame hook, guards and
    bytecode were about a fifth of the demo target's batch-1 decode forward. The prefill graph
    takes a stride among its inputs (a size Dynamo keeps a guard on), so it stays behind Dynamo."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, prefill: bool = True, straight: bool = True):
        """prefill: also steps without a plan (their op runs the torch references: CPU only).
        straight: False sends every step through Dynamo, guards and all: a check that one
        planned graph serves every planned step, which is what a straight call assumes."""
        self.model, self.kv_caches, self.prefill, self.straight = model, kv_caches, prefill, straight
        forward = _own_forward(model)
        self._code = forward.__code__
        self._kept = _KeptGraphs(_INDUCTOR_FORWARD_OPTIONS, roots=("input_ids", "positions", "meta"))
        self._compiled = torch.compile(forward, fullgraph=True, dynamic=False, backend=self._kept,
                                       options={"guard_filter_fn": _guard_step_inputs_only})
        self.is_broken = False  # compiling failed once (no C++ compiler, say): eager from then on
        self.compile_seconds = 0.0
        # steps run through each graph: planned, and with prefill chunks (alone, or beside decode tokens)
        self.num_steps = {"planned": 0, "prefill": 0, "mixed": 0}

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far for this object's forward (two once warm: planned and prefill)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(self._code))

    def covers(self, step: StepInputs, has_layer_callback: bool) -> bool:
        return not self.is_broken and not has_layer_callback and (step.meta.plan is not None or self.prefill)

    @staticmethod
    def kind(step: StepInputs) -> str:
        """Which graph a step runs: what Dynamo's kept guards tell apart (whether the step has a
        plan, and whether the plan is the native op's)."""
        plan = step.meta.plan
        return "prefill" if plan is None else "planned" if plan.query_starts is not None else "planned (torch)"

    def calls_straight(self, kind: str) -> bool:
        """Whether a step of this kind calls its compiled graph without Dynamo (`_KeptGraph`)."""
        return self.straight and self._kept.call(kind) is not None

    def __call__(self, step: StepInputs) -> torch.Tensor:  # [num_tokens, hidden_size]
        meta = step.meta
        self.num_steps["planned" if meta.plan is not None else "mixed" if meta.num_decode_tokens else "prefill"] += 1
        kind = self.kind(step)
        try:
            if self.straight and (call := self._kept.call(kind)) is not None:  # compiled: straight to the graph
                return call(dict(input_ids=step.input_ids, positions=step.positions, meta=meta))
            _mark_sizes_unbacked(step)
            self._kept.kind = kind
            return self._compiled(step.input_ids, step.positions, self.kv_caches, step.meta)
        except Exception as e:  # compilation failed: say so once and stay eager
            self.is_broken = True
            log.warning("graph capture (compile) failed, running eagerly: %r", e)
            return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)

    def warm_up(self, *steps: StepInputs) -> None:
        """Compile now (on dummy steps: one token, and a prefill chunk) rather than in the first
        requests' steps."""
        start = time.perf_counter()
        for step in steps:
            if self.covers(step, False):
                self(step)
        self.compile_seconds = time.perf_counter() - start


# --- guards ---------------------------------------------------------------------------------
#
# Before each call Dynamo checks the graph's guards: that every tensor it was traced with still
# has its shape, dtype and strides, and still carries no dynamic-dimension marks. With the
# model's parameters and the KV caches that was about 600 checks, 0.23 ms a step: 8% of the demo
# target's batch-1 step, more of its draft's. Both are fixed for this object's life (it passes
# the same model and the same cache list on every call, and nothing reshapes them), so their
# guards are left out and only the step's own inputs are checked. That is only sound while
# nothing else runs through the same compiled code, so each `CompiledForward` compiles a forward
# with a code object of its own: Dynamo keeps compiled graphs per code object, and another
# model of the same class (a draft, a second engine) gets graphs of its own instead of being
# matched against these.


def _own_forward(model: torch.nn.Module):
    """`model.forward` with a copy of its code object (same bytecode, new identity)."""
    return types.MethodType(_own_function(model.forward.__func__), model)


def _own_function(fn):
    """fn with a copy of its code object: Dynamo keeps the copy's graphs apart from fn's."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _guard_step_inputs_only(entries) -> list[bool]:
    """Keep every guard except those on the model's attributes (`self.…`) and on the KV cache
    tensors (`kv_caches[…]`)."""
    return [not (e.name.startswith("self.") or e.name.startswith("kv_caches[")) for e in entries]


# Inductor's options for the forward and the draft's passes. Its generated code checks, on every
# call, every input's sizes, strides and alignment: the model's parameters included, about 50 checks a call. The
# guards above already check the step's own inputs and the parameters never change, so the checks
# are off: about 15 µs a call on the AMD EPYC (a draft pass's 0.15 ms, a draft forward's 0.20 ms;
# five calls a speculative step at depth 4). A draft's passes also get Inductor's C++ wrapper (the graph's
# calls made from C++ instead of a Python function): three passes took 0.377 ms against 0.429
# with the Python wrapper (medians of 2000 calls, three interleaved processes each). The forward
# itself gained nothing measurable from it and would pay its longer first compile (the C++
# wrapper adds about 7 s to a start with an empty Inductor cache).
_INDUCTOR_FORWARD_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
_INDUCTOR_PASS_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "cpp_wrapper": True}


class _KeptGraph:
    """A `torch.compile` backend that compiles as Inductor does and keeps what it compiled, so a
    draft's pass (and a step's forward, through `_KeptGraphs`) can call its graph straight,
    without Dynamo on the way.

    Why: a call through `torch.compile` passes Dynamo's frame hook, its guards (those left after
    `_guard_step_inputs_only`) and the bytecode around the graph before Inductor's code starts.
    On the demo draft at batch 1 that was about a third of a pass: 0.30 ms a pass through Dynamo
    against 0.21 ms for the same graph called straight (medians of 2000 calls in one process, the
    Sapphire Rapids Xeon, one thread). A pass runs four or five times a speculative step. On the
    demo target's batch-1 decode forward (AMD EPYC) it was 0.47-0.55 ms against 0.34-0.45 ms.

    `call` exists once exactly one graph was compiled and every input the graph takes is either
    one of the call's own inputs (`roots`: a pass's `state`, `temperature`, `noise`; a step's
    `input_ids`, `positions`, `meta`), a tensor reached from one by attributes
    (`meta.plan.block_ids`), one of their sizes, or a tensor of the model (`self`) or of
    `kv_caches`, taken as fixed for the object's life (the runner allocates both once): the
    trust the dropped guards already place in them. Any other input (one it cannot name, a
    stride, a size Dynamo did not mark unbacked) leaves `call` off. The checks the guards would
    make on the call's own inputs hold by construction: `DraftPasses` and `InputBuffers` make
    them, always tensors of the same dtypes and ranks on the same device, under the inference
    mode the engine steps in. A second graph for the same function (something changed that a
    kept guard checks) turns `call` off, and the call goes through Dynamo from then on."""

    _FIXED = ("L['self']", "L['kv_caches']")  # the model's tensors, the KV caches: their guards are dropped

    def __init__(self, options: dict, roots: tuple[str, ...] = ("state", "temperature", "noise")):
        self.options, self.num_graphs = options, 0
        self._input = re.compile(r"L\['(" + "|".join(roots) + r")'\]((?:\.[A-Za-z_]\w*)*?)(?:\.size\(\)\[(\d+)\])?$")
        self.call = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        from torch._inductor.compile_fx import compile_fx

        inputs = self._inputs(gm, example_inputs)  # before compiling, which may rewrite the graph's nodes
        compiled = compile_fx(gm, example_inputs, config_patches=dict(self.options))
        self.num_graphs += 1
        self.call = self._straight(*inputs, compiled) if inputs is not None and self.num_graphs == 1 else None
        return compiled

    def _inputs(self, gm: torch.fx.GraphModule, example_inputs: list):
        """(fixed, slots): fixed[i] the graph's i-th input when fixed, slots (i, root, getter of
        the attributes from the root or None, dim) of the rest; None when an input cannot be named."""
        fixed, slots = [], []
        for i, (node, value) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
            arg = node.meta.get("grapharg")
            match = self._input.match(arg.source.name) if arg is not None else None
            if match is not None:
                fixed.append(None)
                path = match[2].lstrip(".")  # the attributes from the root to the tensor, as "plan.block_ids"
                slots.append((i, match[1], operator.attrgetter(path) if path else None,
                              None if match[3] is None else int(match[3])))
            elif isinstance(value, torch.Tensor) and arg is not None and arg.source.name.startswith(self._FIXED):
                fixed.append(value)
            else:  # an input it cannot name: through Dynamo
                return None
        return fixed, slots

    @staticmethod
    def _straight(fixed: list, slots: list, compiled):
        def call(inputs: dict) -> torch.Tensor:
            args = list(fixed)
            for i, root, get, dim in slots:
                value = inputs[root] if get is None else get(inputs[root])
                args[i] = value if dim is None else value.shape[dim]
            out = compiled(*args)
            return out[0]
        return call


class _KeptGraphs:
    """One function's graphs told apart by their kind, each kept by a `_KeptGraph`: the caller
    names the kind (`kind`) before a call through Dynamo, and the graph Dynamo compiles in that
    call is that kind's. A step's forward has two: steps with a plan (decode, verification) and
    steps with prefill chunks; Dynamo tells them apart by guards on `meta.plan`, which a straight
    call does not check, so `CompiledForward.kind` makes the same distinction first."""

    def __init__(self, options: dict, roots: tuple[str, ...]):
        self.options, self.roots = options, roots
        self.kind: str | None = None
        self.graphs: dict[str | None, _KeptGraph] = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        graph = self.graphs.setdefault(self.kind, _KeptGraph(self.options, self.roots))
        return graph(gm, example_inputs)

    def call(self, kind: str):
        graph = self.graphs.get(kind)
        return None if graph is None else graph.call


def _mark_sizes_unbacked(step: StepInputs) -> None:
    """Every size that varies between steps: sizes the tracer may not specialise on (1 included)."""
    mark = torch._dynamo.decorators.mark_unbacked
    meta, plan = step.meta, step.meta.plan
    if plan is None:  # `write_and_split_attend`'s tensors
        for t in (step.input_ids, step.positions, meta.slot_mapping, meta.decode_context_lens,
                  meta.extend_cu_seqlens_q, meta.extend_context_lens):
            mark(t, 0)
        for t in (meta.decode_block_tables, meta.extend_block_tables):
            for dim in (0, 1):
                mark(t, dim)
        return
    for dim in (0, 1):  # [num_seqs, num_blocks]
        mark(plan.block_ids, dim)
    if plan.query_starts is not None:  # a native plan: no mask or indices
        for t in (step.input_ids, step.positions, step.meta.slot_mapping, plan.context_lens, plan.query_starts):
            mark(t, 0)
        return
    for t in (step.input_ids, step.positions, step.meta.slot_mapping, plan.pad_index, plan.unpad_index,
              plan.groups_tensor):
        mark(t, 0)
    for dim in (0, 2, 3):  # [num_seqs, 1, max_query_len, length]
        mark(plan.mask, dim)

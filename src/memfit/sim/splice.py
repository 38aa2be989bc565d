"""Exploit the repeated layers: simulate 5 blocks per stack, write the trace of all N.

A 24-layer model runs 24 identical blocks. memfit runs the real model code with each
repeated layer list cut to its first `K = 5` blocks (blocks 0 and 1, one generic block,
the second-to-last and the last), tags every allocation and free with the block that ran
it, and writes the N-block trace by repeating the generic block's events N - 4 times with
fresh storage ids. Which block runs is known from forward hooks in the forward, and in
the backward from the autograd node being executed: nodes are numbered in creation
order (`Node._sequence_nr`), so the range of numbers created during block i's forward
identifies its backward nodes, and `AccumulateGrad` nodes by their parameter.

References between blocks are resolved by offset: when block i frees what block i - 1
allocated, copy n frees what copy n - 1 allocated; blocks 1, 2 and 3 must produce
identical events, so the k-th allocation of block 1 (or 3) stands for the k-th of a
generic copy. A free issued outside the blocks of something every copy allocated frees
all copies.

Passes that follow one another and share per-layer state (generation's KV cache: the prefill fills it, the
decode step replaces each layer's keys and values) are spliced one by one with a `SpliceCarry`: what a
generic block allocated in one pass keeps standing for its copies, so the next pass's block n frees copy n
(a plain splice makes a record that outlives it free all its copies at once, right for what is freed outside
the blocks). `close_carry` ends the run of passes.

The result is checked against the full simulation in tests/sim/test_splice.py (tests/sim/test_grpo.py for
GRPO's generation and scoring passes). The splice is
refused (and the full model simulated) when the two middle blocks of the cut model do not
produce identical events, when a block's events are not contiguous, or when the stack is
too short to gain anything.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field

from torch import nn

from memfit.models.blocks import repeated_layer_lists
from memfit.sim import _torch_adapter as adapter
from memfit.sim.tracker import Record, StorageTracker, TrackedEvent

__all__ = ["K", "GENERIC", "SpliceRefused", "truncate_layers", "LayerTagger", "splice_events", "cut_block",
           "SpliceCarry", "close_carry"]

K = 5  #: blocks kept per repeated stack: 0, 1, the generic one, N-2, N-1
GENERIC = 2  #: the block that stands for blocks 2 .. N-3


class SpliceRefused(Exception):
    """The cut model cannot stand for the full one; simulate the full model instead."""


def truncate_layers(model: nn.Module) -> tuple[nn.Module, dict[int, int], dict[int, str]]:
    """A copy of the (meta) model whose repeated layer lists keep their first K blocks.

    Returns the copy, `{list index: N}` and `{list index: qualified list name}`.
    """
    lists = [(name, ml) for name, ml in repeated_layer_lists(model) if len(ml) > K + 1 and _uniform(model, name)]
    if not lists:
        raise SpliceRefused("no repeated layer list longer than K + 1")
    cut = copy.deepcopy(model)
    sizes, names = {}, {}
    for j, (name, ml) in enumerate(lists):
        target = cut.get_submodule(name)
        kept = nn.ModuleList(list(target)[:K])
        parent_name, _, attr = name.rpartition(".")
        parent = cut.get_submodule(parent_name) if parent_name else cut
        setattr(parent, attr, kept)
        sizes[j], names[j] = len(ml), name
    return cut, sizes, names


def _uniform(model: nn.Module, name: str) -> bool:
    """Whether the blocks of the list `name` all run alike. Qwen2.5-VL's vision tower runs its
    `fullatt_block_indexes` blocks with full attention and the others in windows (modeling_qwen2_5_vl.py
    `Qwen2_5_VisionTransformerPretrainedModel.forward`): blocks 0-4 cannot stand for blocks 7, 15, 23 and 31, so
    that stack is simulated whole (the others are still cut)."""
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    if getattr(getattr(parent, "config", None), "fullatt_block_indexes", None):
        return False
    return not _features_by_index(model, name)


def _features_by_index(model: nn.Module, name: str) -> bool:
    """Whether the model takes its image features from hidden states of the stack `name` chosen by index, which a
    cut stack does not have: LLaVA's `vision_feature_layer` (-2: the input of the last block) selects from the
    vision tower's hidden states, an index transformers resolves against `config.num_hidden_layers`, the full depth
    (utils/output_capturing.py `resolve_hidden_states_indices`); mllama's vision model stacks the hidden states
    `intermediate_layers_indices` ([3, 7, 15, 23, 30]) of its encoder (modeling_mllama.py
    `MllamaVisionModel.forward`); Qwen3-VL's vision tower merges the hidden states of its blocks
    `deepstack_visual_indexes` ([5, 11, 17]) into features that its language model adds to the image positions of
    the outputs of its first len(indexes) blocks, between those blocks (modeling_qwen3_vl.py
    `Qwen3VLVisionModel.forward`, `Qwen3VLTextModel._deepstack_process`), outside any block: both of its stacks
    are simulated whole (a spliced language model with these additions after blocks 0 and 1 differs from the
    full one: tests/sim/test_vlm_exactness.py). Such a stack is simulated whole."""
    if getattr(getattr(model, "config", None), "vision_feature_layer", None) is not None \
            and ".vision_tower." in f".{name}.":
        return True
    parts = name.split(".")
    for i in range(1, len(parts)):  # the stack's enclosing modules, the model itself left out
        config = getattr(model.get_submodule(".".join(parts[:i])), "config", None)
        deepstack = getattr(getattr(config, "vision_config", config), "deepstack_visual_indexes", None)
        if getattr(config, "intermediate_layers_indices", None) or deepstack:
            return True
    return False


class LayerTagger:
    """Knows which (stack, block) of the cut model is running: `current()` -> (j, i) or None."""

    def __init__(self, model: nn.Module, tracker: StorageTracker, names: dict[int, str]) -> None:
        self.tracker = tracker
        self.stack: list[tuple[int, int]] = []
        self.starts: list[int] = []
        self.ranges: list[tuple[int, int, tuple[int, int]]] = []
        self.range_starts: list[int] = []  #: ranges[i][0], ascending (blocks run in order)
        self.param_tag: dict[int, tuple[int, int]] = {}
        self.handles = []
        #: an evaluation (no_grad) forward frees block i - 1's output between blocks i and i + 1 (the
        #: caller's loop rebinds `hidden_states`): with `gaps` on, what runs between two blocks of a stack
        #: is tagged with the block before it, so each generic copy frees its predecessor's output in turn
        self.gaps = False
        self.trailing: tuple[int, int] | None = None
        self.model, self.names = model, names
        self._hook()
        self.index_params()

    def _hook(self, *, prepend: bool = False) -> None:
        for j, name in self.names.items():
            for i, block in enumerate(self.model.get_submodule(name)):
                tag = (j, i)
                self.handles.append(block.register_forward_pre_hook(self._pre(tag), prepend=prepend))
                self.handles.append(block.register_forward_hook(self._post(tag), always_call=True))

    def rehook(self) -> None:
        """Register the hooks again, the pre-forward hooks first and the forward hooks last, so that the block's
        window encloses hooks registered since (FSDP2's all-gather before the block and reshard after it)."""
        self.remove()
        self.handles.clear()
        self._hook(prepend=True)

    def index_params(self) -> None:
        """Map parameters to blocks; call again after `to_empty` (it replaces Parameter objects)."""
        self.param_tag.clear()
        for j, name in self.names.items():
            for i, block in enumerate(self.model.get_submodule(name)):
                for p in block.parameters():
                    self.param_tag[id(p)] = (j, i)

    def _pre(self, tag):
        def hook(module, args):
            self.trailing = None
            self.stack.append(tag)
            self.starts.append(adapter.autograd_sequence_nr())

        return hook

    def _post(self, tag):
        def hook(module, args, output):
            start = self.starts.pop()
            self.stack.pop()
            # the gap after the last block of a stack (the head) stays untagged
            self.trailing = tag if self.gaps and not self.stack and tag[1] < K - 1 else None
            if self.tracker.phase == "forward" and adapter.current_autograd_node() is None:
                self.ranges.append((start, adapter.autograd_sequence_nr(), tag))
                self.range_starts.append(start)

        return hook

    def reset(self) -> None:
        self.ranges.clear()
        self.range_starts.clear()
        self.trailing = None

    def current(self):
        node = adapter.current_autograd_node()
        if node is None:
            return self.stack[-1] if self.stack else self.trailing
        if self.stack:  # recomputation (checkpointing) runs the block's forward inside the backward
            return self.stack[-1]
        var = getattr(node, "variable", None)
        if var is not None:
            return self.param_tag.get(id(var))
        seq = adapter.node_sequence_nr(node)
        k = bisect.bisect_right(self.range_starts, seq) - 1
        if k >= 0 and self.ranges[k][0] <= seq < self.ranges[k][1]:
            return self.ranges[k][2]
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class SpliceCarry:
    """What consecutive `splice_events` calls of one run of passes share (module docstring)."""

    owner: dict = field(default_factory=dict)  #: record id -> tag of the run that allocated it
    copies: dict = field(default_factory=dict)  #: record id of a generic-block record -> {n: copy}


def close_carry(tracker: StorageTracker, carry: SpliceCarry) -> None:
    """End a run of carried passes: a generic record still alive frees all its copies when it is freed."""
    for rid, by_n in carry.copies.items():
        rec = tracker.records[rid]
        if rec.alive and rec.expand_to is None:
            rec.expand_to = [by_n[n] for n in sorted(by_n)]
    carry.owner.clear()
    carry.copies.clear()


def cut_block(n: int, total: int) -> tuple[int, int | None]:
    """Block `n` of a stack of `total` -> (its block in the cut model, the copy index if generic).

    The inverse of `_n_index` for the non-generic blocks.
    """
    if n in (0, 1):
        return n, None
    if n == total - 1:
        return K - 1, None
    if n == total - 2:
        return K - 2, None
    return GENERIC, n


def _n_index(tag, sizes) -> int | None:
    """Block index in the full model of a non-generic block of the cut model."""
    j, i = tag
    n = sizes[j]
    return {0: 0, 1: 1, K - 2: n - 2, K - 1: n - 1}.get(i)


def splice_events(
    tracker: StorageTracker, start: int, sizes: dict[int, int], names: dict[int, str],
    carry: SpliceCarry | None = None,
) -> dict[int, dict[int, Record]]:
    """Rewrite tracker.events[start:] as the full model's events (in place).

    Returns `{record id of a generic-block record: {n: copy}}` for the records that were copied. With `carry`,
    the generic records still alive keep standing for their copies (their free is one event, which the next
    call with the same carry resolves to the copy of the block that frees it); `close_carry` ends the run.
    """
    events = tracker.events[start:]
    # runs of consecutive events with the same tag
    runs: list[tuple[object, list]] = []
    for ev in events:
        tag = ev[3]
        if runs and runs[-1][0] == tag:
            runs[-1][1].append(ev)
        else:
            runs.append((tag, [ev]))
    # check: the generic block's events are contiguous per phase, and blocks 1, 2 and 3 produce
    # identical events (their runs of one phase, concatenated)
    sig: dict[tuple, list] = {}
    alloc_pos: dict[int, tuple[tuple, int]] = {}
    generic_allocs: dict[tuple, list[Record]] = {}
    for tag, evs in runs:
        if tag is None:
            continue
        key = (tag, evs[0][2])
        if tag[1] == GENERIC and key in sig:
            raise SpliceRefused(f"events of block {tag} are not contiguous in phase {evs[0][2]}")
        sig.setdefault(key, []).extend((a, r.size_bytes) for a, r, _, _ in evs)
        allocs = generic_allocs.setdefault((tag[0], tag[1], evs[0][2]), [])
        for a, r, _, _ in evs:
            if a == "alloc":
                alloc_pos[r.id] = (key, len(allocs))
                allocs.append(r)
    for (tag, phase), s_ in sig.items():
        j, i = tag
        if i == GENERIC:
            for other_i in (GENERIC - 1, GENERIC + 1):
                other = sig.get(((j, other_i), phase))
                if other is not None and other != s_:
                    raise SpliceRefused(f"blocks {other_i} and {GENERIC} of stack {names[j]} differ in phase {phase}")

    copies: dict[int, dict[int, Record]] = {} if carry is None else carry.copies
    # record id -> tag of the run that allocated it (None: outside blocks)
    owner: dict[int, object] = {} if carry is None else carry.owner
    out: list = []

    def module_for(rec: Record, j: int, n: int, i: int = GENERIC) -> str:
        """`rec`'s module path with cut block i of stack j named as full-model block n (`layers.2.mlp` ->
        `layers.7.mlp`)."""
        old, new = f"{names[j]}.{i}", f"{names[j]}.{n}"
        m = rec.module
        if m == old:
            return new
        return m.replace(old + ".", new + ".", 1) if m.startswith(old + ".") else m

    def twin_copy(rec: Record, target_n: int, j: int) -> Record | None:
        """The generic copy at `target_n` that stands where block 1's or 3's record `rec` stood."""
        pos = alloc_pos.get(rec.id)
        if pos is None:
            return None
        (_, src_phase), k = pos
        twins = generic_allocs.get((j, GENERIC, src_phase), [])
        return copies.get(twins[k].id, {}).get(target_n) if k < len(twins) else None

    def resolve(rec: Record, src, from_i: int, from_n: int, j: int) -> Record | None:
        """What a free issued by full-model block `from_n` (cut block `from_i`) of `rec` frees."""
        target_n = from_n - (from_i - src[1])
        if src[1] == GENERIC:
            return copies[rec.id].get(target_n)
        if target_n == _n_index(src, sizes):
            return rec
        if src[1] in (GENERIC - 1, GENERIC + 1):
            return twin_copy(rec, target_n, j)
        return None

    for tag, evs in runs:
        phase = evs[0][2]
        if tag is None or tag[1] != GENERIC:
            n_from = None if tag is None else _n_index(tag, sizes)
            pending: list[Record] = []  # consecutive frees, outside the blocks, of generic records
            # the block of the last record of a stack freed outside the blocks before them: frees that come
            # from the last blocks down (a list of per-layer caches dropped: CPython frees a list's items from the
            # end) free the copies from the last down too
            down = [False]

            def flush(ph, tag=tag) -> None:
                # a generic record stands for all its copies; several freed in a row (a per-layer cache
                # dropped at once) are freed copy by copy, as the full model's per-block structures free them
                for n in sorted({n for r in pending for n in copies[r.id]}, reverse=down[0]):
                    for r in pending:
                        t = copies[r.id].get(n)
                        if t is not None and t.alive:
                            t.alive = False
                            out.append(TrackedEvent("free", t, ph, tag))
                pending.clear()

            for action, rec, ph, _ in evs:
                src = owner.get(rec.id, "old") if action == "free" else None
                if src not in ("old", None) and (tag is None or src[0] != tag[0]) and src[1] == GENERIC:
                    pending.append(rec)
                    continue
                if pending:
                    flush(ph)
                if action == "alloc":
                    owner[rec.id] = tag
                    if n_from is not None and n_from != tag[1]:  # the last two blocks: named as the full model's
                        rec.module = module_for(rec, tag[0], n_from, tag[1])
                    out.append(TrackedEvent(action, rec, ph, tag))
                    continue
                if src in ("old", None):
                    out.append(TrackedEvent(action, rec, ph, tag))
                    continue
                if tag is None or src[0] != tag[0]:
                    targets = [rec]  # outside the blocks (a generic record's frees are `pending`)
                    down[0] = src[1] > GENERIC
                else:
                    t = resolve(rec, src, tag[1], n_from, tag[0])
                    targets = [t] if t is not None else []
                for t in targets:
                    if t is rec or t.alive:
                        t.alive = False
                        out.append(TrackedEvent("free", t, ph, tag))
            if pending:
                flush(evs[-1][2])
            continue
        # a generic block: emit one copy per full-model block it stands for
        j, i = tag
        n_total = sizes[j]
        order = range(GENERIC, n_total - 2)
        if phase == "backward":
            order = reversed(order)
        for n in order:
            for action, rec, ph, _ in evs:
                if action == "alloc":
                    owner[rec.id] = tag
                    new = tracker.new_record_like(rec, module_for(rec, j, n))
                    copies.setdefault(rec.id, {})[n] = new
                    out.append(TrackedEvent("alloc", new, ph, (j, n)))
                    continue
                src = owner.get(rec.id, "old")
                if src in ("old", None) or src[0] != j:
                    # allocated outside the blocks: freed once, by the copy at the cut model's index
                    if n == i:
                        out.append(TrackedEvent("free", rec, ph, tag))
                    continue
                t = resolve(rec, src, i, n, j)
                if t is rec:
                    out.append(TrackedEvent("free", rec, ph, (j, n)))
                elif t is not None and t.alive:
                    t.alive = False
                    out.append(TrackedEvent("free", t, ph, (j, n)))
        for action, rec, _, _ in evs:
            if action == "alloc":
                if carry is None:
                    rec.expand_to = [copies[rec.id][n] for n in sorted(copies[rec.id])]
            elif owner.get(rec.id) == tag:
                rec.alive = False
    tracker.events[start:] = out
    return copies

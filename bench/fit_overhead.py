"""Benchmark: what `memfit.fit` costs over a plain `Trainer.train()`, measured side by side.

    python bench/fit_overhead.py          # 3 repeats of each, alternating; prints medians and ratios

The same small BERT (from a config, random weights; no download) trains the same steps on the
same data, once with `trainer.train()` and once with `memfit.fit(trainer, plan=False)`. Per
step: the median wall time of optimizer steps 3..N (a callback stamps `on_step_end`), so the
ratio is memfit's per-step cost (host copy of each micro-batch, loss weighting hooks, the
optimizer-step guard, the host copy of parameters and state on the first step is excluded as
warm-up). Fixed: the whole call minus steps, i.e. memfit's preflight estimate and set-up.
CPU only here: on a GPU the per-step costs differ (non-blocking copies, no device sync).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time


def _trainer(out: str, steps: int):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=4000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, num_labels=2, max_position_embeddings=128)
    model = BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(1, 4000, (96,), generator=g).tolist(), "labels": i % 2}
            for i in range(16 * steps)]

    def collate(batch):
        ids = torch.tensor([b["input_ids"] for b in batch])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "labels": torch.tensor([b["labels"] for b in batch])}

    args = TrainingArguments(out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=steps,
                             report_to="none", logging_strategy="no", save_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collate)


def _stamps():
    from transformers import TrainerCallback

    class Stamps(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    return Stamps()


def _one(kind: str, steps: int) -> tuple[float, float]:
    """(median seconds per optimizer step after two warm-up steps, fixed seconds outside the steps)."""
    import memfit

    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(out, steps)
        stamps = _stamps()
        trainer.add_callback(stamps)
        start = time.perf_counter()
        if kind == "plain":
            trainer.train()
        else:
            memfit.fit(trainer, plan=False)
        total = time.perf_counter() - start
    per_step = [b - a for a, b in zip(stamps.times[1:], stamps.times[2:])]
    step_total = stamps.times[-1] - stamps.times[0]
    return statistics.median(per_step), total - step_total - statistics.median(per_step)


def main(repeats: int = 3, steps: int = 12) -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    results = {"plain": [], "memfit": []}
    for _ in range(repeats):
        for kind in ("plain", "memfit"):  # alternating, so drift hits both alike
            results[kind].append(_one(kind, steps))
    for kind, runs in results.items():
        print(f"{kind}: step_s={[round(r[0], 4) for r in runs]} fixed_s={[round(r[1], 2) for r in runs]}")
    plain_step = statistics.median(r[0] for r in results["plain"])
    fit_step = statistics.median(r[0] for r in results["memfit"])
    extra_fixed = statistics.median(r[1] for r in results["memfit"]) - statistics.median(r[1] for r in results["plain"])
    print(f"step_median_plain_s={plain_step:.4f} step_median_memfit_s={fit_step:.4f} "
          f"step_ratio={fit_step / plain_step:.3f} extra_fixed_s={extra_fixed:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

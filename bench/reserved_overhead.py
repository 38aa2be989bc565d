"""What bounded reserved memory (memfit.allocator.bounded) costs on top of the allocator replays estimate did before.

Before: one replay with the GPU's capacity, plus one without a cap when that one ran out of
memory (or without a GPU). Now: `bounded_reserved` (uncapped replay, capped replay, steady
state of up to 20 optimizer steps, and the smallest-capacity search when the run does not fit
or no GPU is given). Both are timed on the same trace, in CPU seconds of this process
(`time.process_time`, steadier than wall time on a shared machine), median of 5.

    PYTHONPATH=src python bench/reserved_overhead.py

Prints one line per case and, last, `reserved_overhead_max_s=<seconds>`.
"""

from __future__ import annotations

import statistics
import time

from memfit.allocator import replay
from memfit.commands.estimate import SEED_CASE
from memfit.estimator import estimate
from memfit.peaks import peaks
from memfit.allocator.bounded import bounded_reserved
from memfit.train_setup import TrainSetup


def _cases():
    seed = TrainSetup.from_kwargs("xlnet-large-cased", training_args=SEED_CASE["training_args"], task="seq-cls",
                                  num_labels=2, max_length=512)
    return {
        "seed case (V100-16GB)": (seed, "V100-16GB"),
        "seed case (no GPU)": (seed, None),
        "Llama-3.1-8B, 8k tokens, eval (H100-80GB)": (TrainSetup.from_kwargs(
            "meta-llama/Llama-3.1-8B", task="causal-lm", per_device_train_batch_size=1, max_length=8192,
            precision="bf16", eval_strategy="epoch"), "H100-80GB"),
        "Llama-3.1-8B, 2k tokens, ckpt, 8-bit AdamW (H100-80GB)": (TrainSetup.from_kwargs(
            "meta-llama/Llama-3.1-8B", task="causal-lm", per_device_train_batch_size=1, max_length=2048,
            precision="bf16", gradient_checkpointing=True, optim="adamw_bnb_8bit"), "H100-80GB"),
        "flan-t5-large, eval (L4)": (TrainSetup.from_kwargs(
            "google/flan-t5-large", task="seq2seq-lm", per_device_train_batch_size=8, max_length=512,
            target_length=128, precision="bf16", eval_strategy="epoch"), "L4"),
    }


def main() -> None:
    worst = 0.0
    for name, (setup, gpu) in _cases().items():
        r = estimate(setup, gpu=gpu)
        trace, cap = r.trace, r.capacity_bytes
        lower = peaks(trace).overall.bytes
        old, new = [], []
        for _ in range(5):
            t = time.process_time()
            a = replay(trace, capacity_bytes=cap)
            if a.oom is not None or cap is None:
                replay(trace)
            old.append(time.process_time() - t)
            t = time.process_time()
            bounded_reserved(trace, capacity_bytes=cap, lower_bytes=lower)
            new.append(time.process_time() - t)
        o, n = statistics.median(old), statistics.median(new)
        worst = max(worst, n - o)
        st = r.steady_state
        print(f"{name}: {len(trace)} events; before {o:.3f} s, now {n:.3f} s, extra {n - o:.3f} s; "
              f"fits {r.fits}, required {r.required_bytes}, steady state settled after "
              f"{st.settled_after_steps if st else None} of {st.steps_replayed if st else None} steps")
    print(f"reserved_overhead_max_s={worst:.3f}")


if __name__ == "__main__":
    main()

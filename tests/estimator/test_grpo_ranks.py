"""GRPO over several processes: GRPOConfig's `generation_batch_size` counts every process's completions (TRL 1.16
grpo_config.py `__post_init__`), so each rank of `estimate(..., parallel=...)` generates its share."""

from helpers import tiny_config
from memfit.estimator import estimate
from memfit.parallel.setup import ParallelSetup
from memfit.train_setup import TrainSetup

_KW = dict(model=tiny_config("llama", 2), task="causal-lm", trainer="grpo", num_generations=4,
           max_completion_length=8, per_device_train_batch_size=4, eval_strategy="no")


def test_generation_batch_size_is_shared_by_the_ranks():
    ddp = ParallelSetup(world_size=4, strategy="ddp")
    by_total = estimate(TrainSetup(generation_batch_size=32, **_KW), parallel=ddp, gpu="A100-80GB")
    by_steps = estimate(TrainSetup(steps_per_generation=2, **_KW), parallel=ddp, gpu="A100-80GB")  # 32 / (4 x 4)
    read_per_process = estimate(TrainSetup(steps_per_generation=8, **_KW), parallel=ddp, gpu="A100-80GB")
    assert by_total.peak_allocated_bytes == by_steps.peak_allocated_bytes < read_per_process.peak_allocated_bytes
    assert any("each rank generates 8 (steps_per_generation 2)" in n for n in by_total.notes)

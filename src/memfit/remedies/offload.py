"""Optimizer-state CPU offload (opt-in `offload`): DeepSpeed ZeRO-Offload through accelerate.

The optimizer state lives in host memory and the step runs on the CPU (DeepSpeedCPUAdam).
memfit models it as "no optimizer state on the GPU"; the extra traffic and the slower
CPU step are not simulated (known limitation).
"""

from memfit.remedies.base import Applicability, Remedy


def _check(setup, gpu):
    if setup.offload_optimizer_state:
        return Applicability(False, "already offloaded")
    return Applicability(True, "optimizer state in host memory")


def _apply(changes, setup, **_):
    # The "optimizer" section matters: without it Trainer hands DeepSpeed its own AdamW, and DeepSpeed
    # refuses a client optimizer under ZeRO-Offload (`zero_force_ds_cpu_optimizer` defaults to True:
    # deepspeed/runtime/engine.py raises ZeRORuntimeException); with it transformers passes a
    # DummyOptim (integrations/deepspeed.py `deepspeed_optim_sched`) and DeepSpeed builds
    # DeepSpeedCPUAdam. "auto" values are filled from TrainingArguments by transformers.
    return ({"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                     "weight_decay": "auto"}},
                           "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}}, {},
            ["# pip install deepspeed; the optimizer step then runs on the CPU (slower)"])


REMEDY = Remedy(
    name="offload", title="optimizer-state CPU offload", opt_in=True,
    saves="optimizer state (moved to host memory)", costs="optimizer step on the CPU; needs DeepSpeed",
    check=_check, variants=lambda setup, gpu: [{"offload_optimizer_state": True}], apply=_apply,
    fields=("offload_optimizer_state",),
    # ZeRO-Offload steps DeepSpeed's own CPU Adam: with `zero_force_ds_cpu_optimizer` (default True)
    # DeepSpeed refuses a client optimizer such as bitsandbytes' 8-bit AdamW or Adafactor
    # (deepspeed/runtime/engine.py `_configure_optimizer`, ZeRORuntimeException)
    incompatible=("optimizer",),
)

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
    return ({"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}}, {},
            ["# pip install deepspeed; the optimizer step then runs on the CPU (slower)"])


REMEDY = Remedy(
    name="offload", title="optimizer-state CPU offload", opt_in="offload",
    saves="optimizer state (moved to host memory)", costs="optimizer step on the CPU; needs DeepSpeed",
    check=_check, variants=lambda setup, gpu: [{"offload_optimizer_state": True}], apply=_apply,
)

"""vLLM's share of the card next to GRPO training (`vllm_mode="colocate"`): `vllm_gpu_memory_utilization` sized by
the plan, or `vllm_enable_sleep_mode`.

A colocated vLLM holds `vllm_gpu_memory_utilization x` the card's total for the life of its engine
(memfit.gpus.vllm): the larger the share, the larger its KV cache pool and the more completions it decodes at
once, but the training step has only what remains. memfit.planner.grpo_plan sizes the share in closed form from
the training step's reserved peak: the largest share (in hundredths) that leaves the step its peak within the
budget. With sleep mode (level 2) vLLM releases its share outside generation: the training step has the whole
card and the share needs room only beside what training holds while vLLM generates. The share is no fixed
variant: `variants` offers sleep mode, the planner sizes the share of each candidate.
"""

from memfit.remedies.base import Applicability, Remedy
from memfit.train_setup import GENERATING_TRAINERS


def _check(setup, gpu):
    if setup.trainer not in GENERATING_TRAINERS or not setup.use_vllm:
        return Applicability(False, "only GRPO / RLOO generating with vLLM have a vLLM share")
    if setup.vllm_mode != "colocate":
        return Applicability(False, "vLLM runs on other GPUs (server mode): no share of the training GPU")
    return Applicability(True, "a colocated vLLM holds a fixed share of the card; the plan sizes it")


def _variants(setup, gpu):
    if _check(setup, gpu).applies and not setup.vllm_enable_sleep_mode:
        return [{"vllm_enable_sleep_mode": True}]
    return []


def _apply(changes, setup, **_):
    code = []
    if changes.get("vllm_enable_sleep_mode"):
        code.append("# vLLM sleeps (level 2: weights and KV cache released) during the training step and wakes "
                    "before each generation")
    return dict(changes), {}, code


REMEDY = Remedy(
    name="vllm_share", title="vLLM share sized (colocate) or sleep mode",
    saves="the training step's room: a share no larger than the step leaves, or none of it while training (sleep)",
    costs="a smaller share decodes fewer completions at once (slower generation); sleep mode wakes vLLM before "
          "every generation",
    check=_check, variants=_variants, apply=_apply,
    fields=("vllm_gpu_memory_utilization", "vllm_enable_sleep_mode"), trainers=GENERATING_TRAINERS,
)

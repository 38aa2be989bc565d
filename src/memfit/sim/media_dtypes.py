"""16-bit weights that an image or speech model's float32 inputs meet without autocast, and the change that runs.

A processor returns float32 `pixel_values` / `input_features` / `input_values` (transformers' image processors and
feature extractors). With fp32 precision there is no autocast, so they meet the weights as they are: with 16-bit
weights F.conv1d / conv2d raise "Input type (float) and bias type (c10::Half) should be the same" on the model's
first convolution, on a GPU as on the CPU. transformers 5 `from_pretrained` loads a checkpoint in its config's
dtype by default (`dtype="auto"`): openai/whisper-large-v3 says float16, so `memfit plan
openai/whisper-large-v3 --gpu T4` as typed is such a run. (A vision-language model casts `pixel_values` to its
tower's dtype itself and is not one.)

The change a Trainer run needs (`DtypeFix.changes`):

- fp16 weights: fp32 weights (`from_pretrained(..., dtype=torch.float32)`) and mixed precision. fp16 weights
  under `fp16=True` stop at the first optimizer step: torch.amp.GradScaler `unscale_` raises "Attempting to
  unscale FP16 gradients" (torch/amp/grad_scaler.py `_unscale_grads_`). Mixed precision is bf16 where the GPU
  has it (compute capability 8.0+, TrainingArguments refuses bf16 below), else fp16 (a T4 is 7.5).
- bf16 weights: bf16 mixed precision where the GPU has it (no GradScaler), else fp32 weights and fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memfit.models.processors import MediaInputs
    from memfit.train_setup import TrainSetup

__all__ = ["DtypeFix", "dtype_fix", "setup_dtype_fix"]

#: Compute capability from which a GPU has bf16 (TrainingArguments' bf16 check, torch.cuda.is_bf16_supported).
BF16_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class DtypeFix:
    """Weights of a 16-bit dtype that the processor's float32 inputs meet without autocast, and the change."""

    weights_dtype: str  #: the weights' dtype as loaded, e.g. "float16"
    input_name: str  #: the processor's float32 input that meets them, e.g. "input_features"
    changes: dict[str, str]  #: TrainSetup field changes that make the run start (weights_dtype, precision)
    cause: str  #: why the run as given fails, one line
    why_changes: str  #: why these changes, one line

    @property
    def flags(self) -> str:
        """The changes as CLI flags: `--weights-dtype fp32 --precision fp16`."""
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.changes.items())


def dtype_fix(weights: torch.dtype, media: MediaInputs | None, precision: str,
              compute_capability: tuple[int, int]) -> DtypeFix | None:
    """The fix for `weights` meeting the processor's float32 inputs (module docstring); None: no conflict.

    Args:
        weights: the dtype of the model's first floating-point parameter (its first convolution's).
        media: what the processor makes of one example (None: a text model).
        precision: the run's precision (fp32: no autocast).
        compute_capability: the target GPU's (bf16 from 8.0).
    """
    if media is None or media.example is not None:  # a text model, or a VLM (it casts pixel_values itself)
        return None
    floats = [name for name, (_, dtype) in media.tensors.items() if dtype == torch.float32]
    if precision != "fp32" or weights == torch.float32 or not floats:
        return None
    name = str(weights).removeprefix("torch.")
    has_bf16 = tuple(compute_capability) >= BF16_COMPUTE_CAPABILITY
    cc = ".".join(map(str, compute_capability))
    if weights == torch.bfloat16 and has_bf16:
        changes = {"precision": "bf16"}
        why = "bf16 mixed precision casts the inputs to the weights' dtype (no GradScaler with bf16)"
    else:
        changes = {"weights_dtype": "fp32", "precision": "bf16" if has_bf16 else "fp16"}
        why = ("fp32 weights with mixed precision, as a Trainer run needs: "
               + ("fp16 weights under fp16 stop at the first optimizer step (GradScaler: 'Attempting to unscale "
                  "FP16 gradients'); " if weights == torch.float16 else "")
               + (f"bf16 mixed precision where the GPU has it (compute capability {cc})" if has_bf16
                  else f"fp16 mixed precision, since bf16 needs compute capability 8.0 and this GPU has {cc}"))
    cause = (f"the weights are {name} but precision is fp32: the processor's float32 `{floats[0]}` meets {name} "
             "weights without autocast and the first convolution fails")
    return DtypeFix(name, floats[0], changes, cause, why)


def setup_dtype_fix(setup: TrainSetup, compute_capability: tuple[int, int]) -> DtypeFix | None:
    """`dtype_fix` of a resolved setup, from its model prepared as the simulation prepares it (memfit.sim.prepare:
    the weights' dtype after quantization and peft's kbit prep) and its processor's output (memfit.models.processors).
    A cheap None for the runs that cannot have the conflict (autocast, fp32 weights asked for, a text task)."""
    from memfit.train_setup import AUDIO_TASKS, IMAGE_TASKS

    if setup.precision != "fp32" or setup.weights_dtype == "fp32" or setup.task not in AUDIO_TASKS + IMAGE_TASKS \
            or setup.task == "image-text-to-text":
        return None
    from memfit.models.processors import media_inputs
    from memfit.sim.prepare import prepare_model

    prepared = prepare_model(setup, splice=False, compute_capability=tuple(compute_capability), amp_dtype=None)
    weights = next((p.dtype for p in prepared.model.parameters() if p.is_floating_point()), torch.float32)
    return dtype_fix(weights, media_inputs(setup, prepared.spec, prepared.model), setup.precision, compute_capability)

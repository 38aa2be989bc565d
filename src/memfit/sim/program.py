"""When two setups simulate the same program, so that one simulation stands for both (the planners reuse it).

A simulation's result is a pure function of its TrainSetup's fields and the target GPU (memfit.sim.engine:
fake tensors, no randomness, nothing read from the machine). Every field but `notes` can change what runs;
`notes` only say why a field has its value (a QLoRA setup without checkpointing is normalised to checkpointing
on, with a note: memfit.train_setup after peft's `prepare_model_for_kbit_training`; it is then the same run as
QLoRA with checkpointing asked for).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["same_program"]


def same_program(a: Any, b: Any) -> bool:
    """TrainSetups `a` and `b` simulate the same program: every field equal (==) but `notes`."""
    if a is b or a == b:
        return True
    if type(a) is not type(b):
        return False
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a) if f.name != "notes")

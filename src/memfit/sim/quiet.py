"""Upstream libraries' warnings and log lines are not the user's while memfit simulates.

A simulation runs transformers', peft's, bitsandbytes', TRL's and torch's real code on a model
memfit built itself, so what they warn about is memfit's use of them, not the user's run:
deprecations (peft's `PeftModel.__init__` calls transformers 5's deprecated
`is_gradient_checkpointing`), "`use_cache=True` is incompatible with gradient checkpointing",
"Casting fp32 inputs back to torch.bfloat16 for flash-attn compatibility" (after
`prepare_model_for_kbit_training`'s float32 casts). memfit states what matters in its own notes.
`quiet_upstream()` silences Python warnings and sets transformers' logging to errors only for
the duration, then restores both.

Nor may a live run around memfit change a simulation: `without_hf_deepspeed_config()`
(memfit.models.build, where every meta model is built) hides the ZeRO-3 config a DeepSpeed Trainer
in the same process registers (memfit.estimate called next to such a trainer, MemfitCallback,
memfit.fit's preflight), which would build memfit's models under `deepspeed.zero.Init`. Every
simulation runs in `isolated_simulation()`: both.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from memfit.models.build import without_hf_deepspeed_config

__all__ = ["quiet_upstream", "isolated_simulation"]


@contextlib.contextmanager
def quiet_upstream() -> Iterator[None]:
    """No upstream warnings or transformers log lines below ERROR inside the block; both restored after."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_logging.set_verbosity_error()
        try:
            yield
        finally:
            hf_logging.set_verbosity(before)


@contextlib.contextmanager
def isolated_simulation() -> Iterator[None]:
    """`quiet_upstream()` and `without_hf_deepspeed_config()`: what every simulation runs in."""
    with quiet_upstream(), without_hf_deepspeed_config():
        yield

"""Upstream libraries' warnings and log lines are not the user's while memfit simulates.

A simulation runs transformers', peft's, bitsandbytes', TRL's and torch's real code on a model
memfit built itself, so what they warn about is memfit's use of them, not the user's run:
deprecations (peft's `PeftModel.__init__` calls transformers 5's deprecated
`is_gradient_checkpointing`), "`use_cache=True` is incompatible with gradient checkpointing",
"Casting fp32 inputs back to torch.bfloat16 for flash-attn compatibility" (after
`prepare_model_for_kbit_training`'s float32 casts). memfit states what matters in its own notes.
`quiet_upstream()` silences Python warnings and sets transformers' logging to errors only for
the duration, then restores both.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["quiet_upstream"]


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

"""memfit: make Hugging Face fine-tuning fit in GPU memory."""

from __future__ import annotations

__all__: list[str] = []
__version__ = "0.1.0"

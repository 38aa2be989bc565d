"""What memfit knows about models: resolve and build on the meta device (build), the bundled configs
(catalog, configs/), the repeated blocks that gradient checkpointing wraps (blocks), and the
longest sequence a model takes (limits)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.models.build import ModelSpec, resolve_config, build_meta_model, to_empty_tied, shared_parameter_names, default_task
    from memfit.models.catalog import bundled_model_ids, find_bundled, load_bundled_config
    from memfit.models.blocks import repeated_layer_lists, enable_checkpointing, enable_block_checkpointing

__all__ = ["ModelSpec", "resolve_config", "build_meta_model", "to_empty_tied", "shared_parameter_names", "default_task", "bundled_model_ids", "find_bundled", "load_bundled_config", "repeated_layer_lists", "enable_checkpointing", "enable_block_checkpointing"]

_LAZY = {"ModelSpec": "build", "resolve_config": "build", "build_meta_model": "build", "to_empty_tied": "build", "shared_parameter_names": "build", "default_task": "build", "bundled_model_ids": "catalog", "find_bundled": "catalog", "load_bundled_config": "catalog", "repeated_layer_lists": "blocks", "enable_checkpointing": "blocks", "enable_block_checkpointing": "blocks"}


def __getattr__(name: str) -> Any:  # PEP 562: submodules (and torch) load on first use
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"memfit.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

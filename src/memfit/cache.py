"""A cache of estimate results on disk, so the same estimate twice is instant.

An entry is the `--json` report of one estimate (`MemoryReport.to_json()`, JSON, never a
pickle), stored under `$MEMFIT_CACHE_DIR`, else `$XDG_CACHE_HOME/memfit`, else
`~/.cache/memfit`, in `estimate-v1/<key>.json`. The key is the SHA-256 of everything that
changes the result:

* every TrainSetup field (the notes included: they are part of the report);
* the model's config content (a bundled config, or the bytes of a directory's `config.json` or a
  `config.json` file); a model memfit cannot read without transformers (a hub id that is not
  bundled, a `PretrainedConfig` object, an `nn.Module`) is not cached;
* the GPU spec (all its fields), the memory outside PyTorch and the capacity when given;
  `gpu="auto"` (measured now, by NVML) is not cached;
* the allocator config as parsed, and the raw `PYTORCH_ALLOC_CONF` / `PYTORCH_CUDA_ALLOC_CONF`;
* memfit's version and a hash of the source of the installed memfit package (every `.py` and
  `.json` file under it), and the versions of every package whose code runs in a simulation (`_PACKAGES`).

`memfit plan` results are cached the same way (`plan-v1/<key>.json`, `plan_key`): the key holds the
same material plus the plan's own options (allowed and excluded remedies, margin, the allocator
config text, how many plans to verify and return, the memory outside PyTorch); a plan whose budget
depends on what other processes hold on this machine's GPU now (NVML sees a GPU) is not cached.

Entries are written to a temporary file in the same folder and moved into place with
`os.replace` (atomic on POSIX and Windows), so processes sharing the folder read either a whole
entry or none. An entry that cannot be read, is not JSON, or does not hold the key it is named by
is ignored (and replaced by the next store). Nothing else in the folder is touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from memfit.files import write_json_atomic

__all__ = ["cache_dir", "estimate_key", "load_entry", "store_entry", "source_hash", "default_task", "SCHEMA",
           "PLAN_SCHEMA", "plan_key", "load_plan", "store_plan"]

SCHEMA = "memfit.cache.estimate/1"
_SUBDIR = "estimate-v1"
PLAN_SCHEMA = "memfit.cache.plan/1"
_PLAN_SUBDIR = "plan-v1"
#: Packages whose code runs in the simulation: their versions are part of every key.
#: bitsandbytes: quantized layers; trl: its trainers' steps (sim/trl_steps.py); liger-kernel: Liger's
#: patched modules (sim/kernels/liger.py); deepspeed: its config defaults and estimators (parallel/); torchao:
#: Float8Linear (models/float8.py).
_PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "liger-kernel", "deepspeed",
             "torchao")


def cache_dir() -> Path:
    """`$MEMFIT_CACHE_DIR`, else `$XDG_CACHE_HOME/memfit`, else `~/.cache/memfit`."""
    env = os.environ.get("MEMFIT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "memfit" if xdg else Path.home() / ".cache" / "memfit"


@lru_cache(maxsize=1)
def source_hash() -> str:
    """SHA-256 of memfit's installed source: every .py and .json file under the package, by relative path."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def _versions() -> dict[str, str | None]:
    from importlib import metadata

    from memfit._version import __version__

    out: dict[str, str | None] = {"memfit": __version__}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _model_content(model: Any) -> str | None:
    """A digest of the model's config, resolved in the order memfit.models.build.resolve_config uses; None
    when it cannot be read without transformers (then the estimate is not cached)."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    name = os.fspath(model)
    if os.path.isdir(name):
        path = os.path.join(name, "config.json")
        return _file_digest(path) if os.path.isfile(path) else None
    if os.path.isfile(name) and name.endswith(".json"):
        return _file_digest(name)
    from memfit.models.catalog import _read_all, find_bundled

    hub_id = find_bundled(name)
    if hub_id is None:
        return None
    return "bundled:" + hashlib.sha256(json.dumps(_read_all()[hub_id], sort_keys=True).encode()).hexdigest()


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return "file:" + hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def estimate_key(setup: Any, *, gpu: Any, conf: Any, non_pytorch_bytes: int | None,
                 capacity_bytes: int | None) -> str | None:
    """The cache key of one estimate, or None when it must not be cached.

    Args:
        setup: the TrainSetup (after the GPU's compute capability is applied).
        gpu: the GpuSpec, or None.
        conf: the parsed AllocConf.
        non_pytorch_bytes: memory outside PyTorch when given, else None.
        capacity_bytes: memory available to PyTorch when given, else None.
    """
    return _key(SCHEMA, setup, gpu, {"conf": dataclasses.asdict(conf), "non_pytorch_bytes": non_pytorch_bytes,
                                     "capacity_bytes": capacity_bytes})


def _key(schema: str, setup: Any, gpu: Any, options: dict[str, Any]) -> str | None:
    """SHA-256 of the setup, its model's config, the GPU, `options`, the allocator env, versions and source;
    None when the model cannot be keyed or a value is not JSON."""
    model = _model_content(setup.model)
    if model is None:
        return None
    # the other models the run holds (DistillationTrainer's teacher, GRPO's / RLOO's reward model): their configs too
    others = {}
    for name in ("teacher_model", "reward_model"):
        if getattr(setup, name, None) is not None:
            others[name] = _model_content(getattr(setup, name))
            if others[name] is None:
                return None
    fields = {}
    for f in dataclasses.fields(setup):
        value = getattr(setup, f.name)
        fields[f.name] = os.fspath(value) if isinstance(value, os.PathLike) else value
    material = {
        "schema": schema, "setup": fields, "model": model, "other_models": others,
        "gpu": None if gpu is None else dataclasses.asdict(gpu),
        **options,
        "env": {k: os.environ.get(k) for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")},
        "versions": _versions(), "source": source_hash(),
    }
    try:
        text = json.dumps(material, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def plan_key(setup: Any, *, gpu: Any, options: dict[str, Any]) -> str | None:
    """The cache key of one `memfit.plan`, or None when it must not be cached.

    Args:
        setup: the TrainSetup (after the GPU's compute capability is applied).
        gpu: the GpuSpec.
        options: plan's other arguments (allow, exclude, margin, alloc_conf, verify_top, max_plans,
            non_pytorch_bytes), JSON values.
    """
    return _key(PLAN_SCHEMA, setup, gpu, {"plan": options})


def _entry_path(key: str) -> Path:
    return cache_dir() / _SUBDIR / f"{key}.json"


def _load(path: Path, schema: str, key: str, field: str) -> dict[str, Any] | None:
    """`field` of the entry at `path`, or None (missing, unreadable, corrupt, another schema or another key's)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("schema") != schema or data.get("key") != key:
        return None
    value = data.get(field)
    return value if isinstance(value, dict) else None


def _store(path: Path, schema: str, key: str, field: str, value: dict[str, Any]) -> Path | None:
    """Write the entry atomically (a temporary file, then os.replace). Returns its path, or None when the
    folder cannot be written (the cache is an optimisation: a failure never stops an estimate or a plan)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"schema": schema, "key": key, field: value})
        return path
    except (OSError, TypeError, ValueError):
        return None


def load_entry(key: str) -> dict[str, Any] | None:
    """The stored report of `key`, or None (missing, unreadable, corrupt, or another key's)."""
    return _load(_entry_path(key), SCHEMA, key, "report")


def store_entry(key: str, report_json: dict[str, Any]) -> Path | None:
    """Write the estimate entry atomically; None when the folder cannot be written (never stops an estimate)."""
    return _store(_entry_path(key), SCHEMA, key, "report", report_json)


def load_plan(key: str) -> dict[str, Any] | None:
    """The stored `PlanResult.to_json()` of `key`, or None (missing, unreadable, corrupt, or another key's)."""
    return _load(cache_dir() / _PLAN_SUBDIR / f"{key}.json", PLAN_SCHEMA, key, "plan")


def store_plan(key: str, plan_json: dict[str, Any]) -> Path | None:
    """Write the plan entry atomically; None when the folder cannot be written (never stops a plan)."""
    return _store(cache_dir() / _PLAN_SUBDIR / f"{key}.json", PLAN_SCHEMA, key, "plan", plan_json)


def default_task(model: Any) -> tuple[str, str] | None:
    """`memfit.models.build.default_task(model)` (the task and the sentence why), through the cache: that
    function reads the config with transformers (seconds to import), which a cached estimate does not
    need otherwise. None when the model's config cannot be keyed (then the caller resolves it itself)."""
    content = _model_content(model)
    if content is None:
        return None
    material = json.dumps({"schema": "memfit.cache.task/1", "model": content, "name": os.fspath(model),
                           "versions": _versions(), "source": source_hash()}, sort_keys=True)
    key = hashlib.sha256(material.encode()).hexdigest()
    path = cache_dir() / "task-v1" / f"{key}.json"
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if isinstance(data, dict) and data.get("key") == key and isinstance(data.get("task"), str) \
                and isinstance(data.get("why"), str):
            return data["task"], data["why"]
    except (OSError, ValueError, RecursionError):
        pass
    from memfit.models.build import default_task as resolve

    task, why = resolve(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"key": key, "task": task, "why": why})
    except OSError:
        pass  # the cache is an optimisation: a folder that cannot be written only costs the next lookup
    return task, why

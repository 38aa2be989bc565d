"""The web app's form as a memfit command line: each field becomes the CLI flag it stands for, so that the
CLI's own readers (argparse with the setup flags of memfit.commands._setup_flags, TrainSetup, the `--args`
reader, the GPU catalog) validate it and a bad value is their one-line message.

What the app may read is limited to what the user uploaded: a model is a bundled id or a hub id, never a
path on the server (a directory or a config.json there would be read by the CLI), and an uploaded config.json
is checked to be one JSON object without custom code (`auto_map`) before it is written, alone, into a fresh
folder the run reads it from.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import MemfitError

__all__ = ["Form", "ADAPTERS", "STRATEGIES", "MAX_UPLOAD_BYTES", "estimate_argv", "plan_argv", "diagnose_argv",
           "model_argument"]

#: How the model is trained: every weight, LoRA adapters, or LoRA over a 4-bit base (QLoRA).
ADAPTERS = ("full", "LoRA", "QLoRA")
#: "single GPU" or one of the multi-GPU strategies of `--strategy`.
STRATEGIES = ("single GPU", "ddp", "fsdp", "zero1", "zero2", "zero3")
#: Largest upload read (a model's config.json or a TrainingArguments file is a few KiB).
MAX_UPLOAD_BYTES = 1 << 20
#: A hub id: `name` or `owner/name` (huggingface_hub's repo id rule: letters, digits, `-`, `_`, `.`).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class Form:
    """The fields as the page sends them (None or "" where left empty)."""

    model: str | None = None
    config_path: str | None = None  #: an uploaded config.json (the upload's temporary file)
    gpu: str | None = None
    batch_size: float | str | None = None
    grad_accum: float | str | None = None
    max_length: float | str | None = None
    precision: str | None = None
    adapter: str | None = "full"
    lora_r: float | str | None = 16
    trainer: str | None = None
    strategy: str | None = "single GPU"
    gpu_count: float | str | None = 1
    args_path: str | None = None  #: an uploaded --args JSON file


def _number(value: float | str | None) -> str | None:
    """The field as the CLI reads it: `4.0` from a number box is `4`; anything else goes as typed."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _read_upload(path: str, what: str) -> bytes:
    p = Path(path)
    size = p.stat().st_size
    if size > MAX_UPLOAD_BYTES:
        raise MemfitError(f"the uploaded {what} `{p.name}` is {size} bytes; memfit reads at most {MAX_UPLOAD_BYTES} "
                          "(a config.json or an arguments file is a few KiB)")
    return p.read_bytes()


def model_argument(form: Form, workdir: str) -> str | None:
    """The model the run reads: an uploaded config.json (copied alone into `workdir`), else the model field when it
    is a bundled or hub id; None: memfit's built-in example."""
    if form.config_path:
        raw = _read_upload(form.config_path, "config.json")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise MemfitError(f"the uploaded config.json is not JSON ({err}); upload the model's config.json") from err
        if not isinstance(data, dict) or "model_type" not in data:
            raise MemfitError("the uploaded config.json has no `model_type`; upload a transformers model's config.json")
        if "auto_map" in data:
            raise MemfitError("the uploaded config.json names custom model code (`auto_map`), which memfit does not "
                              "run; upload the config of a model transformers implements")
        folder = Path(workdir) / "uploaded-model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(data), encoding="utf-8")
        return str(folder)
    model = (form.model or "").strip()
    if not model:
        return None
    from memfit.models.catalog import find_bundled

    if find_bundled(model) is not None:
        return model
    if not _HUB_ID.match(model) or os.path.exists(model) or model.startswith("."):
        raise MemfitError(f"model `{model}` is not a hub id (`owner/name`) or a bundled model; to use a config of "
                          "your own, upload its config.json")
    return model


def _setup_flags(form: Form) -> list[str]:
    out: list[str] = []
    for flag, value in (("--batch-size", form.batch_size), ("--grad-accum", form.grad_accum),
                        ("--max-length", form.max_length)):
        v = _number(value)
        if v is not None:
            out += [flag, v]
    if form.precision:
        out += ["--precision", form.precision]
    adapter = form.adapter or "full"
    if adapter not in ADAPTERS:
        raise MemfitError(f"training `{adapter}` is not one of {', '.join(ADAPTERS)}")
    if adapter != "full":
        out += ["--lora-r", _number(form.lora_r) or "16"]
    if adapter == "QLoRA":
        out.append("--load-in-4bit")
    if form.trainer:
        out += ["--trainer", form.trainer]
    if form.args_path:
        _read_upload(form.args_path, "arguments file")  # the size check; the CLI's reader reads it
        out += ["--args", form.args_path]
    return out


def _gpu_flags(form: Form) -> list[str]:
    gpu = (form.gpu or "").strip()
    count = _number(form.gpu_count) or "1"
    strategy = form.strategy or "single GPU"
    if strategy not in STRATEGIES:
        raise MemfitError(f"strategy `{strategy}` is not one of {', '.join(STRATEGIES)}")
    if strategy == "single GPU":
        if count != "1":
            raise MemfitError(f"{count} GPUs need a strategy: choose ddp, fsdp or zero1-3, or 1 GPU")
        return ["--gpu", gpu] if gpu else []
    if not gpu:
        raise MemfitError(f"strategy `{strategy}` needs the GPU: choose one, e.g. A100-80GB")
    return ["--gpus", f"{count}x{gpu}", "--strategy", strategy]


def estimate_argv(form: Form, workdir: str) -> list[str]:
    """`memfit estimate ...` for the form (`--html` is added by memfit.ui.jobs.Job)."""
    model = model_argument(form, workdir)
    return ["estimate", *([model] if model else []), *_setup_flags(form), *_gpu_flags(form), "--no-cache"]


def plan_argv(form: Form, workdir: str) -> list[str]:
    """`memfit plan ...` for the form; a QLoRA or LoRA setup lets the search keep it (`--allow`)."""
    model = model_argument(form, workdir)
    allow = {"LoRA": ["--allow", "lora"], "QLoRA": ["--allow", "qlora"]}.get(form.adapter or "full", [])
    return ["plan", *([model] if model else []), *_setup_flags(form), *_gpu_flags(form), *allow]


def diagnose_argv(text: str | None) -> list[str]:
    """`memfit diagnose --text ...` of a pasted message or log."""
    if not text or not text.strip():
        raise MemfitError("nothing to diagnose: paste the out-of-memory message or the end of the training log")
    return ["diagnose", "--text", text]

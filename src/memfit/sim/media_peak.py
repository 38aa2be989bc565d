"""What part of an image or speech model holds the memory at the peak: its parts, and the convolutions over raw
audio of a CTC model.

`parts_at_peak` splits what is live at the allocated peak by the part of the model that allocated it: a
vision-language model's vision tower, projector and language model; Whisper's audio encoder and decoder; a CTC
model's feature encoder and transformer; an image classifier's backbone and head (`model_parts`, from the model's
own `get_encoder` / `get_decoder` and the attribute names memfit.models.freezing knows). A storage belongs to the
part whose module path is the longest prefix of the trace's `module` (the projector inside Qwen2.5-VL's `visual`
is the projector's, not the tower's). The forward's storages carry their module (the weights: their parameter's
name); the backward's gradients and temporaries and the optimizer state carry an autograd node or nothing, so the
split is of the weights and of the activations (what the forward keeps for the backward), the two that differ
between the parts.

A wav2vec2-style model's feature encoder runs seven convolutions over the waveform itself (16,000 samples a second,
512 channels after the first stride-5 convolution): at 20 s a clip, its first layer's output is 512 x 64,000
floats, 131 MB an example, several times the transformer's activations over its 999 positions. When the encoder
is trained (`--no-freeze-feature-encoder`), each layer's convolution, norm and GELU outputs are kept for the
backward and are most of the peak; frozen (transformers' CTC recipe), they are freed as the forward goes.

`feature_encoder_note` replays the trace up to its allocated peak (`memfit.peaks`) and adds up the live storages
allocated in the forward of the feature encoder's modules (the trace's `module` paths), and says so when they are
a large share.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from memfit.peaks import peaks
from memfit.trace import TraceEvent
from memfit.units import format_bytes

__all__ = ["feature_encoder_bytes_at_peak", "feature_encoder_note", "NOTE_SHARE", "PartBytes", "model_parts",
           "parts_at_peak"]

#: The share of the allocated peak above which the note is given.
NOTE_SHARE = 0.25


def _encoder_path(model: nn.Module) -> str | None:
    """The module path of a CTC model's convolutional feature encoder (`wav2vec2.feature_extractor`, under peft
    `base_model.model.wav2vec2.feature_extractor`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _path_of(model, getattr(getattr(inner, "base_model", None), "feature_extractor", None))


def _live_at(trace: list[TraceEvent], index: int) -> dict[int, TraceEvent]:
    """The storages alive after event `index` of `trace`, by id."""
    live: dict[int, TraceEvent] = {}
    for event in trace[: index + 1]:
        if event.action == "alloc":
            live[event.id] = event
        elif event.action == "free":
            live.pop(event.id, None)
    return live


def feature_encoder_bytes_at_peak(trace: list[TraceEvent], path: str) -> tuple[int, int, str]:
    """(bytes live at the allocated peak that the modules under `path` allocated, the peak's bytes, its phase)."""
    result = peaks(trace)
    live = _live_at(trace, result.overall.event_index)
    prefix = path + "."
    held = sum(e.size_bytes for e in live.values() if e.module == path or e.module.startswith(prefix))
    return held, result.overall.bytes, result.phase_of_peak


def feature_encoder_note(trace: list[TraceEvent], model: nn.Module, frozen: bool) -> str | None:
    """A note when the feature encoder's convolutions hold more than NOTE_SHARE of the allocated peak."""
    path = _encoder_path(model)
    if path is None or not trace:
        return None
    held, total, phase = feature_encoder_bytes_at_peak(trace, path)
    if total <= 0 or held < NOTE_SHARE * total:
        return None
    what = ("its outputs, freed as the frozen encoder's forward goes" if frozen else
            "the activations they keep for the backward; freezing the encoder (--freeze-feature-encoder, transformers' "
            "CTC recipe) keeps none")
    return (f"the peak ({phase}) is set by the convolutions over the raw audio: {format_bytes(held)} of its "
            f"{format_bytes(total)} were allocated by the feature encoder (`{path}`), {what}")


@dataclass(frozen=True)
class PartBytes:
    """One part's storages live at the allocated peak (module docstring)."""

    part: str  #: "vision tower", "projector", "language model", "audio encoder", ...; "other" for the rest
    path: str  #: its module path ("" for "other")
    weights_bytes: int
    activations_bytes: int

    def to_json(self) -> dict:
        return {"part": self.part, "path": self.path, "weights_bytes": self.weights_bytes,
                "activations_bytes": self.activations_bytes}


def _path_of(model: nn.Module, module: object) -> str | None:
    if not isinstance(module, nn.Module) or module is model:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)


def _called(model: nn.Module, method: str) -> object:
    """`model.<method>()` (transformers' get_encoder / get_decoder), or None where it has none or cannot say."""
    try:
        return getattr(model, method)() if hasattr(model, method) else None
    except (TypeError, ValueError, AttributeError):
        return None


def model_parts(model: nn.Module, task: str) -> list[tuple[str, str]]:
    """(part, module path) of `model` for `task` (module docstring); [] where it has no distinct parts."""
    from memfit.models.freezing import projector, vision_tower

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    found: list[tuple[str, object]] = []
    if task == "image-text-to-text":
        found = [("vision tower", vision_tower(inner)), ("projector", projector(inner)),
                 ("language model", _called(inner, "get_decoder"))]
    elif task == "speech-seq2seq":
        found = [("audio encoder", _called(inner, "get_encoder")), ("decoder", _called(inner, "get_decoder"))]
    elif task == "ctc":
        base = getattr(inner, "base_model", None)
        found = [("feature encoder", getattr(base, "feature_extractor", None)),
                 ("transformer", getattr(base, "encoder", None))]
    elif task == "image-cls":
        backbone = vision_tower(inner)
        head = next((m for _, m in inner.named_children() if m is not backbone), None)
        found = [("backbone", backbone), ("head", head)]
    out = []
    for part, module in found:
        path = _path_of(model, module)
        if path:
            out.append((part, path))
    return out if len(out) >= 2 else []


def parts_at_peak(trace: list[TraceEvent], parts: list[tuple[str, str]]) -> list[PartBytes]:
    """The weights and activations live at the allocated peak of `trace`, by part (module docstring); the parts in
    order, then "other" (storages under no part's path: a top-level head, the inputs' embedding outside them)."""
    live = _live_at(trace, peaks(trace).overall.event_index)
    by_length = sorted(parts, key=lambda p: -len(p[1]))
    sums = {part: [0, 0] for part, _ in parts} | {"other": [0, 0]}
    for event in live.values():
        if event.category not in ("weights", "activations"):
            continue
        part = next((name for name, path in by_length
                     if event.module == path or event.module.startswith(path + ".")), "other")
        sums[part][0 if event.category == "weights" else 1] += event.size_bytes
    paths = dict(parts)
    return [PartBytes(part, paths.get(part, ""), w, a) for part, (w, a) in sums.items()]

"""What part of a speech model holds the memory at the peak: the convolutions over raw audio of a CTC model.

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

from torch import nn

from memfit.peaks import peaks
from memfit.trace import TraceEvent
from memfit.units import format_bytes

__all__ = ["feature_encoder_bytes_at_peak", "feature_encoder_note", "NOTE_SHARE"]

#: The share of the allocated peak above which the note is given.
NOTE_SHARE = 0.25


def _encoder_path(model: nn.Module) -> str | None:
    """The module path of a CTC model's convolutional feature encoder (`wav2vec2.feature_extractor`, under peft
    `base_model.model.wav2vec2.feature_extractor`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    encoder = getattr(getattr(inner, "base_model", None), "feature_extractor", None)
    if not isinstance(encoder, nn.Module):
        return None
    return next((name for name, module in model.named_modules() if module is encoder), None)


def feature_encoder_bytes_at_peak(trace: list[TraceEvent], path: str) -> tuple[int, int, str]:
    """(bytes live at the allocated peak that the modules under `path` allocated, the peak's bytes, its phase)."""
    result = peaks(trace)
    index = result.overall.event_index
    live: dict[int, TraceEvent] = {}
    for event in trace[: index + 1]:
        if event.action == "alloc":
            live[event.id] = event
        elif event.action == "free":
            live.pop(event.id, None)
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

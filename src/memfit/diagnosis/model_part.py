"""Which part of an image or speech model a traceback's out-of-memory error happened in.

The phase (memfit.diagnosis.phase) says *when* in training; for a vision-language or speech model the frames
also say *where*: transformers' models call their parts by attribute, and the traceback quotes the call. The
innermost frame whose code calls a part decides:

- the vision tower: `self.visual(` (Qwen2-VL, Qwen2.5-VL: modeling_qwen2_5_vl.py `get_image_features`),
  `self.vision_tower(` (LLaVA, Gemma 3, PaliGemma: modeling_llava.py / modeling_gemma3.py `get_image_features`),
  `self.vision_model(` (Idefics3 / SmolVLM, mllama);
- the projector: `self.multi_modal_projector(` (LLaVA, Gemma 3, PaliGemma, mllama), `self.connector(`
  (Idefics3 / SmolVLM), `self.merger(` (inside Qwen2.5-VL's tower);
- a speech model's convolutional feature encoder: `self.feature_extractor(` (wav2vec2, HuBERT:
  modeling_wav2vec2.py `Wav2Vec2Model.forward`);
- Whisper's audio encoder: `self.encoder(` in modeling_whisper.py (`WhisperModel.forward`).

An error in a language model's blocks is not a part here: the phase and the operation say enough. The
projector is called from the model's image path, so a frame inside it is innermost and wins over the tower's
call further out.
"""

from __future__ import annotations

import re

from memfit.diagnosis.phase import _frames
from memfit.oom_text import normalize_log

__all__ = ["PARTS", "model_part"]

#: part id -> (the call in a frame's code line, the model files it is read in; empty: any)
PARTS: dict[str, tuple[re.Pattern[str], tuple[str, ...]]] = {
    "projector": (re.compile(r"\bself\.(?:multi_modal_projector|connector|merger|mm_projector)\("), ()),
    "vision_tower": (re.compile(r"\bself\.(?:visual|vision_tower|vision_model)\(|\bself\.get_image_features\("), ()),
    "feature_encoder": (re.compile(r"\bself\.feature_extractor\("), ()),
    "audio_encoder": (re.compile(r"\bself\.encoder\("), ("modeling_whisper.py",)),
}


def model_part(traceback_text: str) -> tuple[str, str]:
    """(the part id of `PARTS` the innermost part call of the traceback names, its frame line); ("", "") when
    no frame calls one."""
    frames = _frames(normalize_log(traceback_text))
    for file, _func, code, line in reversed(frames):  # innermost first
        for part, (call, files) in PARTS.items():
            if call.search(code) and (not files or any(file.endswith(f) for f in files)):
                return part, f"{line} | {code}"
    return "", ""

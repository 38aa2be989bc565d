"""Colours and labels the views share (HTML and plot), so both draw a category the same way."""

from __future__ import annotations

__all__ = ["category_color", "category_label", "PHASE_COLORS", "phase_label"]

#: One colour per category (a colour-blind-safe qualitative palette, Okabe & Ito 2008, plus greys).
_CATEGORY_COLORS = {
    "weights": "#0072B2",
    "gradients": "#E69F00",
    "optimizer_state": "#009E73",
    "activations": "#D55E00",
    "temporaries": "#CC79A7",
    "eval_outputs": "#56B4E9",
    "workspaces": "#F0E442",
}
_EXTRA = ("#999999", "#666666", "#BBBBBB", "#444444")

_CATEGORY_LABELS = {
    "optimizer_state": "optimizer state",
    "eval_outputs": "evaluation outputs",
    "workspaces": "cuBLAS workspaces",
}

#: Background of the phase bands (light, so the stacked areas stay readable over them).
PHASE_COLORS = {
    "setup": "#f2f2f2",
    "forward": "#e8f1fa",
    "backward": "#fbeee6",
    "optimizer": "#e9f6ef",
    "eval": "#f4ecf7",
}


def category_color(category: str, position: int = 0) -> str:
    """The colour of `category`; a category outside the vocabulary gets a grey by its position."""
    return _CATEGORY_COLORS.get(category) or _EXTRA[position % len(_EXTRA)]


def category_label(category: str) -> str:
    return _CATEGORY_LABELS.get(category, category.replace("_", " "))


def phase_label(phase: str, step: int | None) -> str:
    return phase if step is None else f"{phase} {step}"

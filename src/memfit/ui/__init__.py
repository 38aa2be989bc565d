"""The web app of `memfit ui` (memfit.ui.app, Gradio: the `ui` extra): the CLI's verbs behind a form, their
`--html` pages as results. memfit.ui.form turns the form into a command line the CLI's readers validate;
memfit.ui.jobs runs it in a child process that cancel kills."""

from __future__ import annotations

from typing import Any

__all__ = ["build_app"]


def build_app(**kwargs: Any) -> Any:
    """The Gradio app (memfit.ui.app.build_app)."""
    from memfit.ui.app import build_app as build

    return build(**kwargs)

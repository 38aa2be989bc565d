"""The web app's defaults, in a module of their own so that `memfit --help` reads them without loading the app."""

__all__ = ["DEFAULT_MAX_QUEUE", "DEFAULT_PORT"]

#: Runs waiting at most (more are refused with a message: the queue is full).
DEFAULT_MAX_QUEUE = 8
#: Gradio's own default port.
DEFAULT_PORT = 7860

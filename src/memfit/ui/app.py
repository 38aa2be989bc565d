"""`memfit ui`: the web app (Gradio, the `ui` extra), also a Hugging Face Space unchanged (the repository's
`app.py` builds it).

A form with the setup (model: the bundled list with search, a hub id, or an uploaded config.json; GPU by
name or size; batch, accumulation, length, precision, full / LoRA / QLoRA, trainer, strategy and GPU count;
an `--args` file), buttons for estimate and plan, and a box for an out-of-memory message or log. Each button
runs the CLI's verb with `--html` in a child process (memfit.ui.jobs) and shows its page, the same view as the
`--html` file, in a sandboxed frame; a bad value is the CLI's one-line message in the page.

Limits: one simulation at a time (every run shares one concurrency group of size 1, so each client has at
most one running), a bounded queue (`max_queue`), the elapsed time while it runs, and a cancel button that
kills the run's child process. The page loads nothing from the network (system fonts, Gradio's own bundled
frontend, analytics off).
"""

# no `from __future__ import annotations`: Gradio finds the `gr.Request` parameters by their annotation objects
import html
import tempfile
import threading
from typing import Any

from memfit.errors import MemfitError
from memfit.ui.settings import DEFAULT_MAX_QUEUE, DEFAULT_PORT
from memfit.ui.form import ADAPTERS, STRATEGIES, Form, diagnose_argv, estimate_argv, plan_argv
from memfit.ui.jobs import Job, Outcome, warm_up

__all__ = ["build_app", "launch", "DEFAULT_MAX_QUEUE", "DEFAULT_PORT"]

#: How often the page's status line is updated while a run goes on.
_POLL_S = 0.5

_CSS = """
#memfit-ui-error{color:#b00020;font-weight:600}
"""


def _require_gradio():
    try:
        import gradio as gr
    except ImportError as err:
        raise MemfitError("`memfit ui` needs gradio, which is not installed; `pip install 'memfit[ui]'`") from err
    return gr


class _Runs:
    """The running Job of each client (Gradio's session hash), so that cancel kills the right one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}

    def start(self, session: str, argv: list[str]) -> Job:
        job = Job(argv)
        with self._lock:
            old = self._jobs.pop(session, None)
            self._jobs[session] = job
        if old is not None:
            old.cancel()
        return job

    def done(self, session: str, job: Job) -> None:
        with self._lock:
            if self._jobs.get(session) is job:
                del self._jobs[session]

    def cancel(self, session: str) -> Job | None:
        """Kill the client's running Job; the Job, or None when none runs."""
        with self._lock:
            job = self._jobs.pop(session, None)
        if job is not None:
            job.cancel()
        return job


def _frame(page: str) -> str:
    """The verb's page in a sandboxed frame: its script runs, its ids and styles stay its own, and it can reach
    neither this page nor the network (no `allow-same-origin`)."""
    return (f'<iframe id="memfit-view" srcdoc="{html.escape(page, quote=True)}" sandbox="allow-scripts" '
            'style="width:100%;height:1150px;border:1px solid #ddd;border-radius:6px"></iframe>')


def _message(text: str) -> str:
    return f'<div id="memfit-ui-error" role="alert">{html.escape(text)}</div>'


def _text_block(text: str) -> str:
    return f'<pre id="memfit-ui-text" style="white-space:pre-wrap">{html.escape(text)}</pre>'


def _result(outcome: Outcome) -> str:
    if outcome.error is not None and outcome.html is None:
        return _message(outcome.error)
    if outcome.html is not None:
        return _frame(outcome.html)
    return _text_block(outcome.text or "(no output)")


def _status(outcome: Outcome, what: str, elapsed_s: float) -> str:
    if outcome.code == 130:
        return f"{what}: cancelled after {elapsed_s:.1f} s"
    if outcome.error is not None and outcome.html is None:
        return f"{what}: not run: see the message below"
    return f"{what}: done in {elapsed_s:.1f} s"


def launch(demo: Any, **kwargs: Any) -> Any:
    """`demo.launch(...)` with the page's theme (system fonts: no web font is fetched) and styles."""
    gr = _require_gradio()
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    return demo.launch(theme=theme, css=_CSS, **kwargs)


def build_app(*, max_queue: int = DEFAULT_MAX_QUEUE, warm: bool = True) -> Any:
    """The Gradio Blocks of the app (queue configured). `warm`: import the simulator in the background once the
    app is built, so that the first run does not wait for torch and transformers."""
    gr = _require_gradio()
    from memfit.gpus.catalog import catalog_names
    from memfit.models.catalog import bundled_model_ids
    from memfit.train_setup import TRAINERS

    runs = _Runs()
    warming = threading.Thread(target=warm_up, name="memfit-ui-warm-up", daemon=True) if warm else None

    def run(argv_of, what: str, request: gr.Request):
        session = getattr(request, "session_hash", None) or "local"
        # a fork while another thread imports would leave the child waiting on that import's lock forever
        while warming is not None and warming.is_alive():
            yield f"{what}: loading the simulator (torch, transformers)…", gr.skip()
            warming.join(_POLL_S)
        with tempfile.TemporaryDirectory(prefix="memfit-ui-form-") as workdir:
            try:
                argv = argv_of(workdir)
            except MemfitError as err:
                yield f"{what}: not run: see the message below", _message(f"memfit: error: {err}")
                return
            except OSError as err:
                yield f"{what}: not run", _message(f"memfit: error: cannot read the upload ({err.strerror})")
                return
            job = runs.start(session, argv)
            try:
                while True:
                    outcome = job.poll(_POLL_S)
                    if outcome is not None:
                        break
                    yield f"{what}: simulating\u2026 {job.elapsed_s:.0f} s (cancel stops it)", gr.skip()
                yield _status(outcome, what, job.elapsed_s), _result(outcome)
            finally:  # the page went away or the run was cancelled: the child must not go on
                job.cancel()
                runs.done(session, job)

    # the fields one by one: Gradio passes gr.Request to a parameter annotated with it, not through *args
    def on_estimate(model, config_path, gpu, batch_size, grad_accum, max_length, precision, adapter, lora_r, trainer,
                    strategy, gpu_count, args_path, request: gr.Request):
        form = Form(model, config_path, gpu, batch_size, grad_accum, max_length, precision, adapter, lora_r, trainer,
                    strategy, gpu_count, args_path)
        yield from run(lambda d: estimate_argv(form, d), "estimate", request)

    def on_plan(model, config_path, gpu, batch_size, grad_accum, max_length, precision, adapter, lora_r, trainer,
                strategy, gpu_count, args_path, request: gr.Request):
        form = Form(model, config_path, gpu, batch_size, grad_accum, max_length, precision, adapter, lora_r, trainer,
                    strategy, gpu_count, args_path)
        yield from run(lambda d: plan_argv(form, d), "plan", request)

    def on_diagnose(text, request: gr.Request):
        yield from run(lambda d: diagnose_argv(text), "diagnose", request)

    def on_cancel(request: gr.Request):
        session = getattr(request, "session_hash", None) or "local"
        job = runs.cancel(session)
        return "nothing is running" if job is None else f"{job.argv[0]}: cancelled after {job.elapsed_s:.1f} s"

    with gr.Blocks(title="memfit", analytics_enabled=False) as demo:
        gr.Markdown("## memfit: will this fine-tuning run fit in GPU memory?\n"
                    "Simulated on this machine's CPU with the model's real code; nothing is downloaded but a hub "
                    "model's config.")
        with gr.Row():
            with gr.Column(scale=2):
                model = gr.Dropdown(choices=bundled_model_ids(), value=None, allow_custom_value=True,
                                    filterable=True, label="model (bundled, or type a hub id; empty: the built-in "
                                    "example)", elem_id="model")
                config = gr.File(label="or upload a config.json", file_types=[".json"], type="filepath",
                                 elem_id="config-upload")
                gpu = gr.Dropdown(choices=catalog_names(), value="T4", allow_custom_value=True, filterable=True,
                                  label="GPU (name, or a size like 24GiB)", elem_id="gpu")
            with gr.Column(scale=3):
                with gr.Row():
                    batch = gr.Textbox(label="batch per GPU", value="", placeholder="default", elem_id="batch")
                    accum = gr.Textbox(label="gradient accumulation", value="", placeholder="default",
                                       elem_id="accum")
                    length = gr.Textbox(label="sequence length", value="", placeholder="default", elem_id="length")
                with gr.Row():
                    precision = gr.Dropdown(choices=["", "fp32", "fp16", "bf16"], value="", label="precision",
                                            elem_id="precision")
                    adapter = gr.Radio(choices=list(ADAPTERS), value="full", label="training", elem_id="adapter")
                    lora_r = gr.Textbox(label="LoRA rank", value="16", elem_id="lora-r")
                with gr.Row():
                    trainer = gr.Dropdown(choices=[""] + list(TRAINERS), value="", label="trainer",
                                          elem_id="trainer")
                    strategy = gr.Dropdown(choices=list(STRATEGIES), value="single GPU", label="strategy",
                                           elem_id="strategy")
                    count = gr.Textbox(label="GPUs", value="1", elem_id="gpu-count")
                args_file = gr.File(label="--args: TrainingArguments as JSON (optional)", file_types=[".json"],
                                    type="filepath", elem_id="args-upload")
        with gr.Row():
            estimate_btn = gr.Button("Estimate", variant="primary", elem_id="estimate-btn")
            plan_btn = gr.Button("Plan", elem_id="plan-btn")
            cancel_btn = gr.Button("Cancel", variant="stop", elem_id="cancel-btn")
        oom = gr.Textbox(label="or paste an out-of-memory message or log", lines=4, elem_id="oom-text")
        diagnose_btn = gr.Button("Diagnose", elem_id="diagnose-btn")
        status = gr.Textbox(label="status", interactive=False, elem_id="status")
        result = gr.HTML(elem_id="result")

        inputs = [model, config, gpu, batch, accum, length, precision, adapter, lora_r, trainer, strategy, count,
                  args_file]
        # one concurrency group of size 1: one simulation at a time (each client's at most one)
        common = dict(outputs=[status, result], concurrency_limit=1, concurrency_id="simulation",
                      show_progress="minimal")
        events = [estimate_btn.click(on_estimate, inputs=inputs, **common),
                  plan_btn.click(on_plan, inputs=inputs, **common),
                  diagnose_btn.click(on_diagnose, inputs=[oom], **common)]
        cancel_btn.click(on_cancel, outputs=[status], cancels=events, concurrency_limit=None, queue=False)
    demo.queue(max_size=max_queue)
    if warming is not None:
        warming.start()
    return demo

"""memfit's web app as a Hugging Face Space (Gradio SDK): the Space runs `python app.py`; locally, `memfit ui`
does the same on 127.0.0.1 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT choose the address here, as on a Space)."""

from memfit.ui.app import build_app, launch

demo = build_app()

if __name__ == "__main__":
    launch(demo)

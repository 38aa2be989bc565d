"""Shared test fixtures, for every folder under tests/."""

import os
import sys
from pathlib import Path

# The test files live in one folder per package or topic (tests/<topic>/test_*.py) and import the shared
# module tests/helpers.py as `helpers`: tests/ itself is on sys.path, whichever folder a test is in.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (`derandomize`), so CI does not fail by chance on a
# case no one has seen; explore new ones with HYPOTHESIS_PROFILE=explore (and add what fails as @example).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def save_bert_config(tmp_path_factory, name: str, **dims) -> str:
    """A directory holding a small BERT config.json (a model memfit can load offline)."""
    from transformers import BertConfig

    path = tmp_path_factory.mktemp(name)
    BertConfig(**dims).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    return save_bert_config(tmp_path_factory, "tiny-bert", hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=128, vocab_size=200)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA GPU: skipped on the CPU (CI), run where one is (`pytest -m gpu`)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _memfit_cache_dir(tmp_path_factory, monkeypatch):
    """memfit's result cache (memfit.cache) in a fresh folder per test: tests never write to the real home,
    and no test reads a result another test cached."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.mktemp("memfit-cache")))

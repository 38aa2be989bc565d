"""An upstream error is quoted whole in the one-line MemfitError; a multimodal model without the head asked for
says that it is multimodal."""

import pytest
import transformers

from memfit.errors import MemfitError, first_line
from memfit.models.build import build_meta_model
from memfit.train_setup import TrainSetup


def test_first_line_is_whole():
    long = "x" * 400 + " ends here."
    assert first_line(ValueError(f"\n{long}\nsecond line")) == long.rstrip(".")
    assert first_line(KeyError()) == "KeyError"


def test_a_multimodal_model_without_the_head_says_so():
    cfg = transformers.LlavaConfig(text_config=transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50).to_dict())
    with pytest.raises(MemfitError) as err:
        build_meta_model(TrainSetup(model=cfg, task="seq-cls"))
    text = str(err.value)
    assert "multimodal model" in text and "`vision_config`" in text and "\n" not in text

"""`estimate(model, **fields)` takes a model object the way it takes a model id."""

import torch
from transformers import BertForSequenceClassification

from helpers import tiny_config
from memfit import estimate


def test_a_module_with_keyword_fields():
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_config("bert"))
    report = estimate(model, per_device_train_batch_size=4, max_length=16)
    assert report.setup["per_device_train_batch_size"] == 4 and report.task == "seq-cls"
    by_config = estimate(tiny_config("bert"), task="seq-cls", per_device_train_batch_size=4, max_length=16)
    assert report.params == by_config.params

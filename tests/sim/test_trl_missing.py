"""`--trainer sft` / `dpo` without TRL installed: a one-line hint, as for bitsandbytes and Liger."""

import sys

from helpers import tiny_config
from memfit.process import main


def test_sft_without_trl_is_a_hint(tmp_path, capsys, monkeypatch):
    tiny_config("llama").save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ModuleNotFoundError
    assert main(["estimate", str(tmp_path), "--trainer", "sft", "--max-length", "16", "--batch-size", "1",
                 "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "TRL is not installed" in err and "pip install trl" in err

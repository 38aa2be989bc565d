"""A cached estimate says that it came from the cache, not that it was simulated in 0.0 s."""

from memfit.process import main


def test_second_estimate_says_from_cache(tiny_bert_dir, capsys):
    argv = ["estimate", tiny_bert_dir, "--max-length", "16", "--batch-size", "2", "--gpu", "T4"]
    assert main(argv) == 0
    assert "simulated in" in capsys.readouterr().out
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "from memfit's cache in" in out and "simulated in 0.0 s" not in out

"""The one reader of user-named JSON files (memfit.files.read_json_object) behind `--args`, `diagnose --plan`,
`--deepspeed` and `--fsdp-config`: every way a file can be wrong is a one-line MemfitError naming the file."""

from __future__ import annotations

import pytest

from memfit.commands.diagnose import _saved_plan
from memfit.errors import MemfitError
from memfit.files import read_json_object
from memfit.parallel.accelerate_config import read_accelerate_config
from memfit.parallel.setup import parallel_from_fsdp_args, zero_settings_from_deepspeed
from memfit.train_setup import read_args_file

READERS = {
    "args": lambda p: read_args_file(p),
    "plan": lambda p: _saved_plan(str(p)),
    "deepspeed": lambda p: zero_settings_from_deepspeed(p, hidden_size=8),
    "fsdp_config": lambda p: parallel_from_fsdp_args("full_shard", p, world_size=2),
    "accelerate_config": lambda p: read_accelerate_config(p),  # YAML: the same file errors (read_user_text)
}

BAD = {
    "missing": (None, "does not exist"),
    "folder": ("dir", "is a directory"),
    "not_utf8": ('{"a": "caf\xe9"}'.encode("latin-1"), "not UTF-8"),
    "not_json": (b"{not json", "not valid JSON|not valid YAML"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not valid JSON|not valid YAML"),
    "not_object": (b"[1, 2]", "must hold a JSON object|must hold a mapping"),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("case", sorted(BAD))
def test_every_reader_gives_one_line_errors(tmp_path, reader, case):
    content, match = BAD[case]
    path = tmp_path / "f.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(MemfitError, match=match) as err:
        READERS[reader](path)
    assert "\n" not in str(err.value) and "f.json" in str(err.value)


def test_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"learning_rate": 0.001}')  # what Windows editors write
    assert read_json_object(path, "arguments file", "fix it") == {"learning_rate": 0.001}
    assert read_args_file(path) == {"learning_rate": 0.001}

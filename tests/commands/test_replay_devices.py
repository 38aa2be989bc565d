"""`memfit replay` on a snapshot of several GPUs: one line per device, the device that ran out of memory by default.

Data: tests/data/snapshots/constructor_sun_3gpu_expandable_oom.json.gz (a real trace of three GPUs with
expandable segments, device 1 ending in an `oom` entry; see SOURCE.md).
"""

import gzip
import json
import pickle

import pytest

from helpers import DATA_DIR
from memfit.allocator.snapshot import default_device, device_summaries
from memfit.cli import main

NAME = "constructor_sun_3gpu_expandable_oom.json.gz"


def _snap():
    return json.loads(gzip.decompress((DATA_DIR / "snapshots" / NAME).read_bytes()))


@pytest.fixture()
def three_gpus(tmp_path):
    path = tmp_path / "three_gpus.pickle"
    path.write_bytes(pickle.dumps(_snap()))
    return str(path)


def test_device_summaries_read_from_the_file():
    snap = _snap()
    devices = device_summaries(snap)
    # four device traces, the fourth empty and without segments: three devices
    assert [d.device for d in devices] == [0, 1, 2]
    for d in devices:
        trace = snap["device_traces"][d.device]
        assert d.entries == len(trace)
        assert d.final_reserved_bytes == sum(s["total_size"] for s in snap["segments"] if s["device"] == d.device)
    oom = [e for e in snap["device_traces"][1] if e["action"] == "oom"]
    assert len(oom) == 1 and devices[1].oom_entry == snap["device_traces"][1].index(oom[0])
    assert (devices[1].oom_requested_bytes, devices[1].oom_free_bytes) == (oom[0]["size"], oom[0]["device_free"])
    assert devices[0].oom_entry is None and devices[2].oom_entry is None
    assert default_device(devices) == 1


def test_cli_defaults_to_the_device_that_ran_out_of_memory(three_gpus, capsys):
    assert main(["replay", three_gpus]) == 0  # exact
    out = capsys.readouterr().out
    assert out.startswith(f"memfit replay {three_gpus}: 596 trace entries on device 1;")
    assert "the snapshot holds 3 devices (--device N replays another):" in out
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("device ")]
    assert [ln.split(":")[0] for ln in lines] == ["device 0", "device 1", "device 2"]
    assert "out of memory at entry" in lines[1] and lines[1].endswith("<- replayed")
    assert "91.25 MiB free" in lines[1]
    assert "out of memory" not in lines[0] + lines[2]


def test_cli_replays_the_device_asked_for(three_gpus, capsys):
    assert main(["replay", three_gpus, "--device", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == 2 and out["entries"] == 882 and out["exact"]
    assert [d["device"] for d in out["devices"]] == [0, 1, 2]
    assert out["devices"][1]["oom_entry"] is not None


def test_one_device_snapshot_prints_no_device_list(tmp_path, capsys):
    path = tmp_path / "one.pickle"
    path.write_bytes(pickle.dumps(json.loads(gzip.decompress(
        (DATA_DIR / "snapshots" / "select_n_bert_inference_offload.json.gz").read_bytes()))))
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "on device 0;" in out and "devices (--device N" not in out

"""GPU catalog and resolution."""

import pytest

from memfit.errors import MemfitError
from memfit.gpus.catalog import CATALOG, GpuSpec, catalog_names, resolve_gpu
from memfit.units import GiB, format_size_torch


def test_required_entries():
    for name in ("V100-16GB", "V100-32GB", "T4", "P100-16GB", "RTX-2080Ti", "RTX-3090", "RTX-4090",
                 "A10", "A10G", "L4", "A100-40GB", "A100-80GB", "H100-80GB", "H200"):
        assert name in catalog_names()


def test_totals_print_like_pytorch():
    # the OOM message's "total capacity" is format_size(total_memory)
    assert CATALOG["v100-16gb"].total_bytes == 16945512448
    assert format_size_torch(CATALOG["v100-16gb"].total_bytes) == "15.78 GiB"
    assert format_size_torch(CATALOG["t4"].total_bytes) == "14.75 GiB"
    assert format_size_torch(CATALOG["a100-80gb"].total_bytes) == "79.14 GiB"
    assert format_size_torch(CATALOG["h100-80gb"].total_bytes) == "79.11 GiB"
    for g in CATALOG.values():
        assert g.total_bytes_source


def test_bf16_support_follows_compute_capability():
    assert not resolve_gpu("V100-16GB").supports_bf16
    assert not resolve_gpu("T4").supports_bf16
    assert resolve_gpu("A100-80GB").supports_bf16
    assert resolve_gpu("H100-80GB").bf16_tflops == 989.5


@pytest.mark.parametrize("text,name", [
    ("v100-16g", "V100-16GB"), ("V100-16GB", "V100-16GB"), ("a100-80gb", "A100-80GB"),
    ("h100-80gb", "H100-80GB"), ("T4", "T4"), ("rtx 4090", "RTX-4090"), ("4090", "RTX-4090"), ("A10G", "A10G"),
])
def test_names_and_aliases(text, name):
    assert resolve_gpu(text).name == name


def test_plain_sizes_give_a_generic_gpu():
    g = resolve_gpu("12GiB")
    assert isinstance(g, GpuSpec) and g.total_bytes == 12 * GiB
    assert g.compute_capability == (8, 0) and g.notes
    assert resolve_gpu("16GB").total_bytes == 16 * 10**9


def test_unknown_names_list_the_catalog():
    with pytest.raises(MemfitError, match="`Z80`.*H100-80GB.*B200"):
        resolve_gpu("Z80")
    with pytest.raises(MemfitError, match="`1MiB`"):
        resolve_gpu("1MiB")


def test_auto_without_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MemfitError, match="no CUDA GPU.*V100-16GB"):
        resolve_gpu("auto")
    with pytest.raises(MemfitError):
        resolve_gpu(None)


def test_api_gpu_and_setup_arguments_are_clear_errors():
    import pytest

    from memfit import estimate, plan
    from memfit.errors import MemfitError
    from memfit.gpus.catalog import CATALOG, as_gpu_spec

    assert as_gpu_spec(None) is None and as_gpu_spec(CATALOG["t4"]) is CATALOG["t4"]
    assert as_gpu_spec("T4") == CATALOG["t4"]
    for bad in (3, 1.5, ["T4"]):
        with pytest.raises(MemfitError, match="is not a GPU"):
            as_gpu_spec(bad)
    with pytest.raises(MemfitError, match="is not a GPU"):
        plan("bert-base-uncased", gpu=None)
    with pytest.raises(MemfitError, match="is not a TrainSetup"):
        estimate(3)
    with pytest.raises(MemfitError, match="is not a TrainSetup"):
        plan(3, gpu="T4")


# --- the multi-GPU flags: --gpus resolves names as --gpu does; --world-size must be positive ---

def test_gpus_takes_the_names_gpu_takes():
    from memfit.parallel.setup import parse_gpus

    assert parse_gpus("8xNVIDIA H100 80GB HBM3") == (8, "NVIDIA H100 80GB HBM3")
    count, name = parse_gpus("4 x rtx pro 6000")
    assert count == 4 and resolve_gpu(name).name == "RTX-PRO-6000"
    assert resolve_gpu(parse_gpus("8xNVIDIA H100 80GB HBM3")[1]).name == "H100-80GB"
    for bad in ("0xA100-80GB", "A100-80GB", "8x "):
        with pytest.raises(MemfitError, match="COUNTxGPU"):
            parse_gpus(bad)


def test_world_size_zero_is_a_one_line_error():
    import argparse

    from memfit.commands._args import parallel_from_args

    args = argparse.Namespace(world_size=0, gpus=None, accelerate_config=None, strategy=None, deepspeed=None,
                              fsdp=None, fsdp_config=None, nodes=None)
    with pytest.raises(MemfitError, match="--world-size `0` must be at least 1") as err:
        parallel_from_args(args, None)
    assert "\n" not in str(err.value)

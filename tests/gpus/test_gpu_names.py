"""GPU names (typed and as nvidia-smi / torch print them), ambiguous names, bare numbers, new entries.

What this guards against: `--gpu a100` silently meaning A100-80GB, nvidia-smi names refused, L40S ... MI300X
missing, and `--gpu 24` saying "too small" instead of asking for a unit.
"""

from types import SimpleNamespace

import pytest

from memfit.errors import MemfitError
from memfit.gpus.catalog import CATALOG, _NAME_TABLE, catalog_names, resolve_gpu, spec_from_device
from memfit.units import GiB, format_size_torch

# (catalog name, the "total capacity" figure PyTorch printed in the cited message or the
# unverified figure the source explains, compute capability)
NEW_ENTRIES = [
    ("L40S", "44.42 GiB", (8, 9)), ("L40", "44.40 GiB", (8, 9)), ("RTX-A6000", "47.54 GiB", (8, 6)),
    ("RTX-6000-Ada", "44.43 GiB", (8, 9)), ("RTX-3060", "11.76 GiB", (8, 6)),
    ("RTX-3080-10GB", "9.78 GiB", (8, 6)), ("RTX-3080-12GB", "11.76 GiB", (8, 6)),
    ("RTX-4080", "15.99 GiB", (8, 9)), ("RTX-5090", "31.36 GiB", (12, 0)), ("H100-PCIe", "79.11 GiB", (9, 0)),
    ("H100-NVL", "93.00 GiB", (9, 0)), ("H20", "95.00 GiB", (9, 0)), ("B200", "178.35 GiB", (10, 0)),
    ("MI250", "63.98 GiB", (9, 0)), ("MI250X", "63.98 GiB", (9, 0)), ("MI300X", "191.98 GiB", (9, 4)),
    ("A40", "44.43 GiB", (8, 6)), ("A800-80GB", "79.14 GiB", (8, 0)), ("H800", "79.11 GiB", (9, 0)),
    ("GH200", "94.88 GiB", (9, 0)), ("GB200", "184.30 GiB", (10, 0)), ("L20", "44.42 GiB", (8, 9)),
    ("RTX-PRO-6000", "94.97 GiB", (12, 0)), ("RTX-4060Ti-8GB", "7.80 GiB", (8, 9)),
    ("RTX-4060Ti-16GB", "15.70 GiB", (8, 9)), ("RTX-4070", "11.76 GiB", (8, 9)),
]


@pytest.mark.parametrize("name,printed,cc", NEW_ENTRIES)
def test_new_entries_print_like_pytorch(name, printed, cc):
    g = resolve_gpu(name)
    assert g.name == name
    assert format_size_torch(g.total_bytes) == printed
    assert g.total_bytes_source.startswith(printed)
    assert g.compute_capability == cc
    assert g.sm_count and g.memory_bandwidth_gbps > 0 and g.fp16_tflops > g.fp32_tflops / 2


def test_every_entry_cites_the_figure_it_prints():
    for g in CATALOG.values():
        assert format_size_torch(g.total_bytes) in g.total_bytes_source, g.name
        assert ("unverified" in g.total_bytes_source) or ("#" in g.total_bytes_source) \
            or ("exact bytes" in g.total_bytes_source) or (".md" in g.total_bytes_source), g.name


def test_amd_entries_say_rocm_and_use_the_gfx_capability():
    for name in ("MI250", "MI250X", "MI300X"):
        g = CATALOG[name.lower()]
        assert g.vendor == "amd" and any("ROCm" in n for n in g.notes)
        assert g.supports_bf16
    assert CATALOG["mi250x"].tf32_tflops is None  # CDNA2 has no TF32
    assert {g.vendor for g in CATALOG.values()} == {"nvidia", "amd"}


SMI_NAMES = [
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"), ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("NVIDIA GeForce RTX 3090", "RTX-3090"),
    ("NVIDIA GeForce RTX 2080 Ti", "RTX-2080Ti"), ("Tesla V100-SXM2-16GB", "V100-16GB"),
    ("Tesla V100-PCIE-32GB", "V100-32GB"), ("Tesla V100-SXM2-32GB", "V100-32GB"), ("Tesla T4", "T4"),
    ("Tesla P100-PCIE-16GB", "P100-16GB"), ("NVIDIA A10G", "A10G"), ("NVIDIA A10", "A10"), ("NVIDIA L4", "L4"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H100 NVL", "H100-NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H20", "H20"), ("NVIDIA B200", "B200"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"), ("NVIDIA RTX A6000", "RTX-A6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada"), ("NVIDIA GeForce RTX 3060", "RTX-3060"),
    ("NVIDIA GeForce RTX 4080", "RTX-4080"), ("NVIDIA GeForce RTX 5090", "RTX-5090"),
    ("AMD Instinct MI300X", "MI300X"), ("AMD Instinct MI250X", "MI250X"), ("AMD Instinct MI250", "MI250"),
]


@pytest.mark.parametrize("printed,name", SMI_NAMES)
def test_nvidia_smi_names_resolve_case_insensitively(printed, name):
    assert resolve_gpu(printed).name == name
    assert resolve_gpu(printed.upper()).name == name
    assert resolve_gpu(printed.lower()).name == name


@pytest.mark.parametrize("typed,name", [
    ("l40s", "L40S"), ("a6000", "RTX-A6000"), ("rtx 6000 ada", "RTX-6000-Ada"), ("rtx3060", "RTX-3060"),
    ("3060", "RTX-3060"), ("rtx 3080 12gb", "RTX-3080-12GB"), ("rtx-3080-10gb", "RTX-3080-10GB"),
    ("4080", "RTX-4080"), ("rtx_5090", "RTX-5090"), ("h100 pcie", "H100-PCIe"), ("h100-sxm", "H100-80GB"),
    ("h100 nvl", "H100-NVL"), ("mi300x", "MI300X"), ("MI250X", "MI250X"), ("4090", "RTX-4090"),
    ("tesla-t4", "T4"), ("a100-40g", "A100-40GB"), ("h200-141gb", "H200"),
    ("NVIDIA A40", "A40"), ("NVIDIA A800-SXM4-80GB", "A800-80GB"), ("NVIDIA A800 80GB PCIe", "A800-80GB"),
    ("NVIDIA H800", "H800"), ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA GB200", "GB200"), ("NVIDIA L20", "L20"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX-PRO-6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000"), ("rtx pro 6000", "RTX-PRO-6000"),
    ("rtx 4060 ti 16gb", "RTX-4060Ti-16GB"), ("4060ti-8gb", "RTX-4060Ti-8GB"),
    ("NVIDIA GeForce RTX 4070", "RTX-4070"), ("4070", "RTX-4070"),
])
def test_short_names_users_type(typed, name):
    assert resolve_gpu(typed).name == name


def test_every_catalog_name_resolves_to_itself_and_the_table_points_into_the_catalog():
    for name in catalog_names():
        assert resolve_gpu(name).name == name
        assert resolve_gpu(name.upper().replace("-", " ")).name == name
    for _, target in _NAME_TABLE:
        for n in (target if isinstance(target, tuple) else (target,)):
            assert n.lower() in CATALOG


@pytest.mark.parametrize("text,choices", [
    ("a100", ["A100-40GB", "A100-80GB"]), ("A100", ["A100-40GB", "A100-80GB"]),
    ("v100", ["V100-16GB", "V100-32GB"]), ("h100", ["H100-80GB", "H100-PCIe", "H100-NVL"]),
    ("NVIDIA H100", ["H100-80GB", "H100-PCIe", "H100-NVL"]), ("rtx 3080", ["RTX-3080-10GB", "RTX-3080-12GB"]),
    ("NVIDIA GeForce RTX 3080", ["RTX-3080-10GB", "RTX-3080-12GB"]),
    ("AMD Instinct MI250X/MI250", ["MI250X", "MI250"]),
])
def test_ambiguous_names_ask_with_the_choices(text, choices):
    with pytest.raises(MemfitError, match="ambiguous") as err:
        resolve_gpu(text)
    message = str(err.value)
    assert f"`{text}`" in message and "\n" not in message
    for choice in choices:
        assert choice in message


def test_rtx_6000_names_the_cards_outside_the_catalog():
    with pytest.raises(MemfitError, match="ambiguous: RTX-6000-Ada.*RTX-PRO-6000.*Quadro RTX 6000.*24GiB"):
        resolve_gpu("rtx 6000")


def test_4060_ti_and_a800_ask_for_the_memory():
    with pytest.raises(MemfitError, match="ambiguous: RTX-4060Ti-8GB.*RTX-4060Ti-16GB"):
        resolve_gpu("NVIDIA GeForce RTX 4060 Ti")
    with pytest.raises(MemfitError, match="ambiguous: A800-80GB.*40GB PCIe"):
        resolve_gpu("a800")
    # detection settles the 4060 Ti by the device's own memory
    assert spec_from_device("NVIDIA GeForce RTX 4060 Ti", CATALOG["rtx-4060ti-16gb"].total_bytes, (8, 9), 34).name \
        == "RTX-4060Ti-16GB"


@pytest.mark.parametrize("text,guess", [
    ("24", "`24GiB`"), (" 80 ", "`80GiB`"), ("24.5", "`24.5GiB`"), ("6000", "`6000MiB`"),
    ("16945512448", "`16945512448B` (15.78 GiB)"),
])
def test_bare_numbers_ask_for_a_unit(text, guess):
    with pytest.raises(MemfitError, match="has no unit") as err:
        resolve_gpu(text)
    assert guess in str(err.value) and "too small" not in str(err.value)


def test_sizes_with_units_keep_working():
    assert resolve_gpu("24G").total_bytes == 24 * GiB
    assert resolve_gpu("24GiB").total_bytes == 24 * GiB
    assert resolve_gpu("24 GiB").total_bytes == 24 * GiB
    assert resolve_gpu("24gb").total_bytes == 24 * 10**9
    assert resolve_gpu(f"{16945512448}B").total_bytes == 16945512448


@pytest.mark.parametrize("text,kind", [
    ("NVIDIA GeForce RTX 3060 Laptop GPU", "laptop GPU"),
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "MIG slice"),
])
def test_laptop_gpus_and_mig_slices_ask_for_a_size(text, kind):
    with pytest.raises(MemfitError, match=f"is a {kind}.*GiB"):
        resolve_gpu(text)


def test_variants_with_other_memory_are_not_silently_mapped():
    for text in ("NVIDIA GeForce RTX 3060 Ti", "NVIDIA GeForce RTX 4080 SUPER", "Tesla P100-PCIE-12GB",
                 "Quadro RTX 6000", ""):
        with pytest.raises(MemfitError):
            resolve_gpu(text)
    with pytest.raises(MemfitError, match="closest: .*RTX-4070"):
        resolve_gpu("rtx 4070 ti")
    with pytest.raises(MemfitError, match="not in the catalog"):  # 300 W, lower clocks: not the 600 W card
        resolve_gpu("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition")


# --- detection (`auto`) uses the same table; the device's own figures win ---

def test_detected_name_takes_the_device_memory_and_capability():
    g = spec_from_device("NVIDIA A100-SXM4-80GB", 85_000_000_000, (8, 0), 108)
    assert g.name == "A100-80GB" and g.total_bytes == 85_000_000_000
    assert g.bf16_tflops == 312.0 and g.total_bytes_source == "detected: NVIDIA A100-SXM4-80GB"
    assert spec_from_device("AMD Instinct MI300X", CATALOG["mi300x"].total_bytes, (9, 4), 304).vendor == "amd"


def test_detected_ambiguous_names_are_settled_by_memory_and_sm_count():
    pcie = CATALOG["h100-pcie"]
    assert spec_from_device("NVIDIA H100", pcie.total_bytes, (9, 0), 114).name == "H100-PCIe"
    assert spec_from_device("NVIDIA H100", pcie.total_bytes, (9, 0), 132).name == "H100-80GB"
    mi = CATALOG["mi250"].total_bytes
    assert spec_from_device("AMD Instinct MI250X/MI250", mi, (9, 0), 104).name == "MI250"
    assert spec_from_device("AMD Instinct MI250X/MI250", mi, (9, 0), 110).name == "MI250X"
    assert spec_from_device("NVIDIA GeForce RTX 3080", int(11.7 * GiB), (8, 6), 70).name == "RTX-3080-12GB"
    assert spec_from_device("NVIDIA GeForce RTX 3080", int(9.8 * GiB), (8, 6), 68).name == "RTX-3080-10GB"


def test_detected_unknown_laptop_or_unsettled_devices_are_generic_with_a_note():
    for name, cc in (("Quadro RTX 6000", (7, 5)), ("NVIDIA GeForce RTX 4090 Laptop GPU", (8, 9)),
                     ("NVIDIA H100", (9, 0))):
        g = spec_from_device(name, 64 * GiB, cc, 120)
        assert g.name.startswith("generic-") and g.total_bytes == 64 * GiB and g.compute_capability == cc
        assert g.notes and name in g.notes[0] and g.total_bytes_source == f"detected: {name}"


def test_auto_reads_the_device_through_the_same_table(monkeypatch):
    import torch

    props = SimpleNamespace(name="NVIDIA H100 PCIe", total_memory=84_942_979_072, major=9, minor=0,
                            multi_processor_count=114)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    g = resolve_gpu("auto")
    assert g.name == "H100-PCIe" and g.total_bytes == 84_942_979_072 and g.compute_capability == (9, 0)
    assert g.bf16_tflops == 756.5 and g.sm_count == 114

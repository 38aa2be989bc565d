"""How fast GPUs talk to each other and to the host: the links the multi-GPU planner's communication model uses
(memfit.planner.comm).

All figures are GB/s (10**9 bytes/s) in one direction per GPU, the unit NCCL's tests report ("The
measurement is of a unidirectional bandwidth", NVIDIA/nccl-tests doc/PERFORMANCE.md). Datasheets quote
NVLink as the total of both directions, so the figure here is half the datasheet's:

* NVLink per GPU (datasheet totals, both directions): V100 SXM2 300 GB/s ("NVIDIA Tesla V100 GPU
  Accelerator" datasheet), A100 SXM4 600 GB/s ("NVIDIA A100 Tensor Core GPU" datasheet), H100 SXM and H200
  900 GB/s ("NVIDIA H100 Tensor Core GPU" / "NVIDIA H200 Tensor Core GPU" datasheets), H20 900 GB/s (NVIDIA's
  product brief as reported), B200 1.8 TB/s ("NVIDIA HGX B200" spec table). AMD MI300X: Infinity Fabric
  896 GB/s peak aggregate ("AMD Instinct MI300X" datasheet).
* PCIe x16, per direction: lanes x transfer rate x 128/130 encoding / 8: Gen3 8 GT/s -> 15.75 GB/s, Gen4
  16 GT/s -> 31.5 GB/s, Gen5 32 GT/s -> 63.0 GB/s (PCI-SIG PCIe 3.0/4.0/5.0 base specifications). It is both
  the GPU-to-GPU link of PCIe machines (through the host bridge or a switch) and the host link every GPU has
  (CPU offload's traffic).
* Between nodes: the network, in Gb/s per node (`network_gbps`); the default 100 Gb/s is a commodity
  Ethernet/InfiniBand EDR node, not a measurement; DGX A100 has 8 x 200 Gb/s HDR and DGX H100 8 x 400 Gb/s
  NDR for compute (NVIDIA DGX A100 / DGX H100 user guides): pass 1600 or 3200 there.

The V100 and A100 entries of the catalog share SXM and PCIe boards (SXM clocks): they default to NVLink, and a
PCIe board is `interconnect="pcie"`. H100 NVL pairs are bridged by NVLink (600 GB/s) only two by two: the
default is the PCIe Gen5 link that joins more than two. GPUs not listed (sizes such as `24GiB`, MI250/MI250X
whose per-GCD links memfit does not model) default to PCIe Gen4, with a note.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError

__all__ = ["Interconnect", "interconnect_for", "PCIE_GBPS", "DEFAULT_NETWORK_GBPS", "INTERCONNECT_KINDS"]

#: PCIe x16, GB/s per direction (module docstring: PCI-SIG base specifications, 128b/130b encoding)
PCIE_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}

#: Gb/s per node between nodes when the user gives none (module docstring: an assumption)
DEFAULT_NETWORK_GBPS = 100.0

INTERCONNECT_KINDS = ("nvlink", "pcie")

# catalog name -> (NVLink GB/s per direction or None, PCIe generation of the host link)
_LINKS: dict[str, tuple[float | None, int]] = {
    "V100-16GB": (150.0, 3), "V100-32GB": (150.0, 3),      # 300 GB/s NVLink 2 total
    "A100-40GB": (300.0, 4), "A100-80GB": (300.0, 4),      # 600 GB/s NVLink 3 total
    "H100-80GB": (450.0, 5), "H200": (450.0, 5), "H20": (450.0, 5),  # 900 GB/s NVLink 4 total
    "B200": (900.0, 5),                                    # 1.8 TB/s NVLink 5 total
    "MI300X": (448.0, 5),                                  # 896 GB/s Infinity Fabric aggregate
    "H100-PCIe": (None, 5), "H100-NVL": (None, 5), "RTX-5090": (None, 5),
    "T4": (None, 3), "P100-16GB": (None, 3), "RTX-2080Ti": (None, 3),
    "A10": (None, 4), "A10G": (None, 4), "L4": (None, 4), "L40": (None, 4), "L40S": (None, 4),
    "RTX-3090": (None, 4), "RTX-4090": (None, 4), "RTX-A6000": (None, 4), "RTX-6000-Ada": (None, 4),
    "RTX-3060": (None, 4), "RTX-3080-10GB": (None, 4), "RTX-3080-12GB": (None, 4), "RTX-4080": (None, 4),
}


@dataclass(frozen=True)
class Interconnect:
    """The links of one rank: to its peers in the node, to the host, and its node's share of the network."""

    kind: str  #: "nvlink" or "pcie": what joins the GPUs of one node
    intra_node_gbps: float  #: GB/s per direction per GPU within a node
    host_gbps: float  #: GB/s per direction between the GPU and host memory (PCIe x16)
    network_gbps: float  #: Gb/s per node between nodes (bits)
    pcie_gen: int
    note: str = ""

    def to_json(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def interconnect_for(gpu_name: str, *, kind: str | None = None, network_gbps: float | None = None) -> Interconnect:
    """The links of a catalog GPU (module docstring), or PCIe Gen4 for one memfit does not list.

    Args:
        gpu_name: the GpuSpec's name.
        kind: "nvlink" or "pcie" to override the default (a PCIe A100, an NVLink-less machine); None: the default.
        network_gbps: Gb/s per node between nodes; None: DEFAULT_NETWORK_GBPS.
    """
    if kind is not None and kind not in INTERCONNECT_KINDS:
        raise MemfitError(f"interconnect `{kind}` is not one of {', '.join(INTERCONNECT_KINDS)}")
    if network_gbps is None:
        network_gbps = DEFAULT_NETWORK_GBPS
    if isinstance(network_gbps, bool) or not isinstance(network_gbps, (int, float)) or network_gbps <= 0:
        raise MemfitError(f"network bandwidth `{network_gbps!r}` must be a positive number of Gb/s per node "
                          "(e.g. 100, 200, 400)")
    nvlink, gen = _LINKS.get(gpu_name, (None, 4))
    note = "" if gpu_name in _LINKS else (f"`{gpu_name}`: links not in memfit's table; taken as PCIe Gen4 "
                                          "(pass the interconnect if it has NVLink)")
    if kind == "nvlink" and nvlink is None:
        raise MemfitError(f"interconnect `nvlink`: memfit has no NVLink figure for `{gpu_name}`; "
                          f"its GPUs talk over PCIe Gen{gen} here (leave the interconnect out)")
    use_nvlink = nvlink is not None and kind != "pcie"
    return Interconnect("nvlink" if use_nvlink else "pcie", nvlink if use_nvlink else PCIE_GBPS[gen],
                        PCIE_GBPS[gen], float(network_gbps), gen, note)

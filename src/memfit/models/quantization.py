"""Quantized base weights (bitsandbytes 4-bit / LLM.int8), built as `from_pretrained(quantization_config=...)`
builds them, on the meta device.

What a real load does, and what memfit runs of it:

* transformers' own quantizer (`AutoHfQuantizer.from_config(BitsAndBytesConfig)`, transformers 5.24
  quantizers/quantizer_bnb_4bit.py / _8bit.py `_process_model_before_weight_loading`) decides which
  `nn.Linear` become `bnb.nn.Linear4bit` / `Linear8bitLt` (`get_modules_to_not_convert`: the LM head via
  `get_keys_to_not_convert`, `llm_int8_skip_modules`, `_keep_in_fp32_modules`) and swaps them
  (integrations/bitsandbytes.py `replace_with_bnb_linear`). memfit calls it on the meta model.
* loading quantizes each weight (`Bnb4bitQuantize` -> `Params4bit._quantize` -> `bnb.functional.quantize_4bit`;
  `Bnb8bitQuantize` -> `Int8Params._quantize` -> `int8_vectorwise_quant`). memfit runs bitsandbytes' own
  Python code on meta tensors (its ops have `register_fake` shapes), so the packed weight, absmax, the
  nested state (double quant) and the code tables have the shapes and dtypes bitsandbytes gives them.
  `quantized_storage` gives the same bytes as a formula; tests/models/test_quantization.py checks both against a
  real CPU quantization.
* `peft.prepare_model_for_kbit_training` (peft/utils/other.py) is run for real on the meta model
  (`kbit_prep`; TRL 1.16's SFTTrainer does not call it, see TrainSetup.kbit_prep): it freezes everything and casts
  every fp16/bf16 parameter that is not quantized to
  float32 (embeddings, norms, the LM head: "QLoRA uses more memory than LoRA"), and with its default
  `use_gradient_checkpointing=True` enables input gradients and gradient checkpointing (TrainSetup records
  that as `gradient_checkpointing=True`, with a note).

`to_empty` (the simulator's `model.to("cuda")`) drops the bitsandbytes parameter subclasses and leaves the
quant states on the meta device; `capture` / `restore` put them back on the simulated device.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from memfit.errors import MemfitError

__all__ = ["QuantSpec", "quant_spec", "quantize_meta_model", "prepare_for_kbit_training", "unquantized_experts",
           "capture", "restore",
           "quant_state_tensors", "quantized_storage", "plain_4bit_weights", "meta_safe_deepcopy", "parameter_count", "quiet_bnb_logs", "quantization_summary", "BLOCKSIZE_4BIT",
           "NESTED_BLOCKSIZE"]

#: Params4bit's blocksize when none is given (bitsandbytes nn/modules.py `Params4bit.__new__`: None -> 64);
#: transformers passes none (integrations/bitsandbytes.py `Bnb4bitQuantize.convert`).
BLOCKSIZE_4BIT = 64
#: Blocksize of the second (nested) quantization of absmax (bitsandbytes functional.py `quantize_4bit`:
#: `quantize_blockwise(absmax - offset, blocksize=256)`).
NESTED_BLOCKSIZE = 256
#: Entries of the 4-bit code table kept per layer (`get_4bit_type`: 16 float32 values) and of the 8-bit
#: dynamic map of the nested state (`create_dynamic_map`: 256 float32 values).
CODE_4BIT_ENTRIES = 16
CODE_8BIT_ENTRIES = 256


@dataclass(frozen=True)
class QuantSpec:
    """One BitsAndBytesConfig, as the simulation needs it."""

    bits: int  #: 4 or 8
    quant_type: str = "fp4"  #: nf4 | fp4 (4-bit)
    compute_dtype: str = "float32"  #: torch dtype name Linear4bit computes in
    double_quant: bool = False
    quant_storage: str = "uint8"
    threshold: float = 6.0  #: LLM.int8 outlier threshold
    skip_modules: tuple[str, ...] | None = None

    @property
    def method(self) -> str:
        return f"bitsandbytes-{self.bits}bit"


def quant_spec(setup: Any) -> QuantSpec | None:
    """The QuantSpec of a TrainSetup, or None when its base weights are not quantized."""
    if not (setup.load_in_4bit or setup.load_in_8bit):
        return None
    skip = tuple(setup.llm_int8_skip_modules) if setup.llm_int8_skip_modules is not None else None
    return QuantSpec(bits=4 if setup.load_in_4bit else 8, quant_type=setup.bnb_4bit_quant_type,
                     compute_dtype=setup.bnb_4bit_compute_dtype or "float32",  # BitsAndBytesConfig: None -> float32
                     double_quant=setup.bnb_4bit_use_double_quant, quant_storage=setup.bnb_4bit_quant_storage,
                     threshold=float(setup.llm_int8_threshold), skip_modules=skip)


def _bnb_config(spec: QuantSpec):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=spec.bits == 4, load_in_8bit=spec.bits == 8, bnb_4bit_quant_type=spec.quant_type,
        bnb_4bit_compute_dtype=spec.compute_dtype, bnb_4bit_use_double_quant=spec.double_quant,
        bnb_4bit_quant_storage=spec.quant_storage, llm_int8_threshold=spec.threshold,
        llm_int8_skip_modules=list(spec.skip_modules) if spec.skip_modules is not None else None,
    )


@contextlib.contextmanager
def quiet_bnb_logs() -> Iterator[None]:
    """bitsandbytes' logger warnings off: at import its CPU backend reports that the optional `kernels` package
    is missing, and MatMul8bitLt warns at every call that it casts inputs to fp16 (what CUDA does too)."""
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _import_bnb():
    try:
        with quiet_bnb_logs():
            import bitsandbytes as bnb  # noqa: F401
            from bitsandbytes.nn import Int8Params, Linear4bit, Linear8bitLt, Params4bit
    except ImportError as err:
        raise MemfitError("quantized weights (`load_in_4bit`/`load_in_8bit`) need bitsandbytes: "
                          "`pip install 'memfit[llm]'` or `pip install bitsandbytes`") from err
    return Linear4bit, Linear8bitLt, Params4bit, Int8Params


def quantize_meta_model(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """Swap the Linear layers transformers would quantize and quantize their (meta) weights, in place.

    Args:
        model: a transformers model built on the meta device in its load dtype.
        spec: the quantization settings.
    """
    Linear4bit, Linear8bitLt, Params4bit, Int8Params = _import_bnb()
    from transformers.quantizers import AutoHfQuantizer

    dtypes = {name: (m.weight.dtype, None if m.bias is None else m.bias.dtype)
              for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantizer = AutoHfQuantizer.from_config(_bnb_config(spec), pre_quantized=False)
    # PreTrainedModel.from_pretrained: hf_quantizer.preprocess_model(model=..., dtype=..., device_map=...)
    quantizer.preprocess_model(model=model, device_map={"": 0})
    meta = torch.device("meta")
    for name, module in model.named_modules():
        if not isinstance(module, (Linear4bit, Linear8bitLt)):
            continue
        w_dtype, b_dtype = dtypes.get(name, (torch.float32, torch.float32))
        shape = (module.out_features, module.in_features)
        data = torch.empty(shape, dtype=w_dtype, device=meta)  # the checkpoint's weight, in its load dtype
        if isinstance(module, Linear4bit):
            p = Params4bit(data, requires_grad=False, blocksize=BLOCKSIZE_4BIT, compress_statistics=spec.double_quant,
                           quant_type=spec.quant_type, quant_storage=getattr(torch, spec.quant_storage), module=module)
            module.weight = p._quantize(meta)
        else:
            p = Int8Params(data, requires_grad=False, has_fp16_weights=False)
            module.weight = p._quantize(meta)
        if module.bias is not None and b_dtype is not None:
            module.bias = nn.Parameter(torch.empty(module.out_features, dtype=b_dtype, device=meta),
                                       requires_grad=False)
    model.hf_quantizer = quantizer  # from_pretrained keeps it; Trainer's validate_quantization_for_training reads it
    # HfQuantizer.postprocess_model -> _process_model_after_weight_loading
    quantizer.postprocess_model(model)
    return model


def prepare_for_kbit_training(model: nn.Module, use_gradient_checkpointing: bool = True) -> int:
    """peft's `prepare_model_for_kbit_training` on the (meta) model, as users call it: by default
    (`use_gradient_checkpointing=True`, `gradient_checkpointing_kwargs=None` -> `{}`)
    `enable_input_require_grads()` and `gradient_checkpointing_enable(gradient_checkpointing_kwargs={})`.
    TrainSetup turns `gradient_checkpointing` on for it (unless `kbit_use_gradient_checkpointing` is False), so the
    simulator's checkpointing (the same call, with the setup's kwargs) applies to the cut model too. Returns how
    many parameters it cast from fp16/bf16 to float32."""
    import warnings

    from peft import prepare_model_for_kbit_training

    half = {id(p): p.numel() for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5: gradient_* -> activation_* renames
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=use_gradient_checkpointing)
    return sum(half[id(p)] for p in model.parameters() if id(p) in half and p.dtype == torch.float32)


def unquantized_experts(model: nn.Module) -> tuple[int, int, list[str]]:
    """(elements, bytes, names) of the fused expert weights bitsandbytes leaves unquantized: transformers 5 MoE
    blocks (MixtralExperts, Qwen2MoeExperts, ...) hold all experts as one 3-D parameter (`gate_up_proj`,
    `down_proj`: experts x out x in), not `nn.Linear` layers, and `replace_with_bnb_linear` replaces only
    `nn.Linear` (transformers integrations/bitsandbytes.py), so these keep their dtype."""
    seen: dict[int, tuple[str, Any]] = {}
    for name, p in model.named_parameters():
        if p.ndim == 3 and "expert" in name.lower():
            seen.setdefault(id(p), (name, p))
    params = [p for _, p in seen.values()]
    kinds = sorted({n.rsplit(".", 1)[-1] for n, _ in seen.values()})
    return (sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params), kinds)


@contextlib.contextmanager
def meta_safe_deepcopy() -> Iterator[None]:
    """`copy.deepcopy` of a model with meta `Params4bit` (the simulator's cut model, memfit.sim.splice).

    bitsandbytes' `Params4bit.__deepcopy__` builds the copy around a CPU `torch.empty(0)` and then sets a meta
    tensor as its data, which torch refuses ("incompatible tensor type"); this builds it from the copied data.
    """
    _, _, Params4bit, _ = _import_bnb()
    original = Params4bit.__deepcopy__

    def deepcopy_meta(self, memo):
        new = Params4bit(copy.deepcopy(self.data, memo), requires_grad=self.requires_grad,
                         quant_state=copy.deepcopy(self.quant_state, memo), blocksize=self.blocksize,
                         compress_statistics=self.compress_statistics, quant_type=self.quant_type,
                         quant_storage=self.quant_storage, module=copy.deepcopy(self.module, memo),
                         bnb_quantized=self.bnb_quantized)
        memo[id(self)] = new
        return new

    Params4bit.__deepcopy__ = deepcopy_meta
    try:
        yield
    finally:
        Params4bit.__deepcopy__ = original


# -- the quant states across `to_empty` -----------------------------------------------------------------------
def _linear_kinds():
    Linear4bit, Linear8bitLt, _, _ = _import_bnb()
    return Linear4bit, Linear8bitLt


def _bnb_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    try:
        Linear4bit, Linear8bitLt = _linear_kinds()
    except MemfitError:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (Linear4bit, Linear8bitLt))]


def capture(model: nn.Module) -> dict[int, dict[str, Any]]:
    """What `to_empty` loses of each bitsandbytes layer: the parameter subclass's attributes. A 4-bit layer whose
    weight is no longer the bnb parameter (sharded by FSDP: `plain_4bit_weights`) is read from the module, where
    bitsandbytes keeps them for that case (`Linear4bit.quant_state` / `.quant_storage`, set by
    `Params4bit._quantize`; `fix_4bit_weight_quant_state_from_module` reads them back)."""
    Linear4bit, _ = _linear_kinds()
    out = {}
    for _, m in _bnb_modules(model):
        w = m.weight
        if isinstance(m, Linear4bit) and getattr(w, "quant_state", None) is None:
            qs = m.quant_state
            out[id(m)] = dict(kind=4, quant_state=qs, blocksize=qs.blocksize, compress_statistics=qs.nested,
                              quant_type=qs.quant_type, quant_storage=m.quant_storage)
        elif isinstance(m, Linear4bit):
            out[id(m)] = dict(kind=4, quant_state=w.quant_state, blocksize=w.blocksize,
                              compress_statistics=w.compress_statistics, quant_type=w.quant_type,
                              quant_storage=w.quant_storage)
        else:
            out[id(m)] = dict(kind=8, SCB=w.SCB)
    return out


def plain_4bit_weights(model: nn.Module, *, floating_only: bool = True) -> list[nn.Parameter]:
    """Give each 4-bit layer a plain frozen Parameter of its packed storage in place of the `Params4bit`, on the
    (meta) model, before an engine shards it; returns those whose storage is not floating (left as they are).

    Under FSDP a sharded or all-gathered parameter is a plain tensor (`Params4bit.__torch_function__` wraps the
    chunks FSDP2 cuts, which a FakeTensor cannot be), and bitsandbytes reads the quantization state back from the
    module (`fix_4bit_weight_quant_state_from_module`; memfit.sim.kernels.bnb `bnb_cuda_patches`): the bytes are the
    packed storage's, sharded as any frozen parameter of that dtype. With a storage that is not floating
    (`bnb_4bit_quant_storage` uint8, the default) accelerate leaves the weight out of FSDP2's sharding
    (accelerate 1.16 utils/fsdp_utils.py `fsdp2_prepare_model`: `incompatible_params4bit` -> `ignored_params`)."""
    _, _, Params4bit, _ = _import_bnb()
    Linear4bit, _ = _linear_kinds()
    kept = []
    for _, m in _bnb_modules(model):
        w = m.weight
        if not isinstance(m, Linear4bit) or not isinstance(w, Params4bit):
            continue
        if floating_only and not w.is_floating_point():
            kept.append(w)
            continue
        m.quant_state, m.quant_storage = w.quant_state, w.quant_storage
        m.weight = nn.Parameter(w.data, requires_grad=False)  # the same (meta) storage, without the subclass
    return kept


def _empty_like(t: torch.Tensor | None, device) -> torch.Tensor | None:
    # torch.empty, not empty_like: a fake mode would first convert the meta input to a FakeTensor (~2 ms each)
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=device)


def restore(model: nn.Module, captured: dict[int, dict[str, Any]], device: str | torch.device) -> None:
    """Give the layers back their bitsandbytes parameters, the quant state tensors on `device`."""
    _, _, Params4bit, Int8Params = _import_bnb()
    for _, m in _bnb_modules(model):
        info = captured.get(id(m))
        if info is None:
            continue
        if info["kind"] == 4:
            qs = info["quant_state"]
            qs.absmax = _empty_like(qs.absmax, device)
            qs.code = _empty_like(qs.code, device)
            if qs.nested:
                qs.offset = _empty_like(qs.offset, device)
                qs.state2.absmax = _empty_like(qs.state2.absmax, device)
                qs.state2.code = _empty_like(qs.state2.code, device)
            # The bitsandbytes subclass cannot wrap a FakeTensor; the attributes bitsandbytes reads are set on
            # the parameter instead (Linear4bit.forward: `fix_4bit_weight_quant_state_from_module` returns when
            # `weight.quant_state` is set; matmul_4bit takes the quant state as an argument).
            w = m.weight
            for key in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
                setattr(w, key, info[key])
            w.quant_state, w.bnb_quantized, w.module = qs, True, m
            m.quant_state = qs
            # bnb's CPU-only inference repacking (Linear4bit.forward, `_convert_weight_packed_for_cpu`) never
            # runs on CUDA
            m.support_avx512bf16_for_cpu = False
        else:
            w = m.weight  # Int8Params' attributes (Linear8bitLt.forward -> init_8bit_state reads CB / SCB)
            w.CB, w.SCB, w.has_fp16_weights = w.data, _empty_like(info["SCB"], device), False


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The device tensors of the quantization states that are not parameters (absmax, code tables, SCB)."""
    Linear4bit, _ = _linear_kinds()
    out = []
    for _, m in _bnb_modules(model):
        w = m.weight
        if isinstance(m, Linear4bit):
            qs = w.quant_state
            out += [qs.absmax, qs.code]
            if qs.nested:
                out += [qs.offset, qs.state2.absmax, qs.state2.code]
        elif getattr(w, "SCB", None) is not None:
            out.append(w.SCB)
    return [t for t in out if isinstance(t, torch.Tensor)]


# -- storage, as a formula -------------------------------------------------------------------------------------
def quantized_storage(out_features: int, in_features: int, spec: QuantSpec) -> dict[str, int]:
    """Bytes of one quantized Linear weight, by tensor (bitsandbytes 0.50 `_ops.py` fake kernels and
    functional.py `quantize_4bit` / `int8_vectorwise_quant`).

    4-bit: the packed weight `((n + 1) // (2 * itemsize), 1)` of `quant_storage`; absmax float32 per
    block of 64 (uint8 with double quant, plus the nested float32 absmax per 256 blocks, its 256-entry
    float32 code and a float32 offset); the 16-entry float32 code. 8-bit: int8 weight plus float32 SCB
    per output row.
    """
    n = out_features * in_features
    if spec.bits == 8:
        return {"weight": n, "SCB": 4 * out_features}
    itemsize = getattr(torch, spec.quant_storage).itemsize
    blocks = -(-n // BLOCKSIZE_4BIT)
    out = {"weight": ((n + 1) // (2 * itemsize)) * itemsize, "code": 4 * CODE_4BIT_ENTRIES}
    if spec.double_quant:
        out.update(absmax=blocks, nested_absmax=4 * -(-blocks // NESTED_BLOCKSIZE),
                   nested_code=4 * CODE_8BIT_ENTRIES, offset=4)
    else:
        out["absmax"] = 4 * blocks
    return out


def parameter_count(model: nn.Module) -> int:
    """Parameters of the model as the unquantized model has them: a quantized layer counts
    `out_features * in_features`, not the elements of its packed storage."""
    mods = _bnb_modules(model)
    packed = {id(m.weight) for _, m in mods}
    plain = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in packed)
    return plain + sum(m.out_features * m.in_features for _, m in mods)


def quantization_summary(model: nn.Module, spec: QuantSpec, *, kbit_prep: bool) -> dict[str, Any]:
    """The report's `quantization` object: what is quantized, its bytes, and what stays in higher precision."""
    mods = _bnb_modules(model)
    q_params = sum(m.out_features * m.in_features for _, m in mods)
    q_bytes = sum(sum(quantized_storage(m.out_features, m.in_features, spec).values()) for _, m in mods)
    quantized_ids = {id(m.weight) for _, m in mods}
    higher: dict[str, dict[str, int]] = {}
    for name, p in model.named_parameters():
        if id(p) in quantized_ids:
            continue
        entry = higher.setdefault(str(p.dtype).removeprefix("torch."), {"params": 0, "bytes": 0})
        entry["params"] += p.numel()
        entry["bytes"] += p.numel() * p.element_size()
    not_converted = sorted(getattr(getattr(model, "hf_quantizer", None), "modules_to_not_convert", []) or [])
    out = {
        "method": spec.method, "bits": spec.bits, "quantized_modules": len(mods), "quantized_params": q_params,
        "quantized_bytes": q_bytes, "higher_precision": higher, "modules_not_converted": not_converted,
        "kbit_prep": kbit_prep,
    }
    if spec.bits == 4:
        out.update(quant_type=spec.quant_type, compute_dtype=spec.compute_dtype, double_quant=spec.double_quant,
                   quant_storage=spec.quant_storage, blocksize=BLOCKSIZE_4BIT)
    else:
        out.update(threshold=spec.threshold)
    return out

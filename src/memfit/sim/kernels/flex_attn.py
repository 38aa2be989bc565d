"""FlexAttention (`attn_implementation="flex_attention"`) emulated on the CPU behind transformers' own
flex path, with the allocations of the CUDA (Triton) kernel torch.compile builds.

Why an emulation: torch 2.13 refuses flex attention's backward on the CPU (torch/_higher_order_ops/
flex_attention.py: "FlexAttention does not support backward on CPU"), and transformers 5.24 runs it compiled
(integrations/flex_attention.py `WrappedFlexAttention`: `torch.compile(flex_attention)`; masking_utils
`flex_attention_mask`: `create_block_mask(..., _compile=True)`). transformers' `flex_attention_forward` (the
score_mod closure, GQA through `enable_gqa` or `repeat_kv`, the final `transpose(1, 2).contiguous()`) and
`flex_attention_mask` (the mask_mod with its padding mask) run unchanged; only `compile_friendly_flex_attention`
and `create_block_mask` are replaced (`flex_patches`). Sources read (installed torch 2.13):

* Forward, inductor's lowering `torch/_inductor/kernel/flex/flex_attention.py` `flex_attention`: the Triton
  template writes `out` of shape (B, Hq, Sq, Dv) in the query's dtype with strides that keep the query's layout
  permutation (`infer_dense_strides`, "matches the behavior of empty_like()"), `logsumexp` and `max_scores` of
  shape (B, Hq, Sq) in float32 ("always stored in fp32 regardless of the input dtype"). No S x S matrix.
* Saved for the backward: the backward op `flex_attention_backward(query, key, value, out, logsumexp, grad_out,
  grad_logsumexp, ..., block_mask, ...)` (`FlexAttentionAutogradOp.backward`) reads q, k, v, out, logsumexp and
  the block mask's tensors, not `max_scores`; under torch.compile AOTAutograd's partitioner saves what the
  backward graph reads, so `max_scores` is a forward temporary (the eager autograd function, which cannot run
  backward on the CPU, saves it too: tests/sim/test_flex_attn.py pins both rules to the installed source).
* Backward, the lowering `flex_attention_backward`: `delta = sum(out * grad_out, -1)` realised in float32
  (B, Hq, Sq) (the product is fused into the reduction), `grad_query` like the query, `broadcasted_grad_key` /
  `broadcasted_grad_value` of shape (Bq, Hkv, Skv, D) like the key / value (GQA is resolved inside the kernel:
  no Hq-sized expansion; the sum over the batch only when the key/value batch is 1, never in training).
* Block mask, `torch/nn/attention/flex_attention.py` `create_block_mask` -> `_convert_mask_to_block_mask` ->
  `_create_sparse_block_from_block_mask` -> `BlockMask.from_kv_blocks`: int32 `kv_num_blocks` (B, H, Sq/128) and
  `kv_indices` (B, H, Sq/128, Skv/128) (`_dense_to_ordered`), the same for the full blocks
  (`separate_full_blocks=True`), and the q-side ones `from_kv_blocks` derives (`_transpose_ordered`). memfit
  allocates the four kv-side tensors the compiled mask kernel returns and runs the real `from_kv_blocks` for
  the rest; transformers passes `H=None` (1 head). Assumption: compiled, the mask_mod evaluation is fused into
  the block reduction, so the (B, H, Sq, Skv) boolean mask of the eager path never exists.

Known limitations: on CUDA transformers also asks for the logsumexp (`return_lse` is `device.type != "cpu"`) and
casts it to the value dtype (`lse.to(value.dtype)`, a (B, H, S) transient freed at once without attention sinks);
the simulated device is the CPU, so that branch does not run. Attention sinks (`s_aux`, gpt-oss) therefore raise
transformers' own CPU error. Tensors a score_mod captures (a 4D score mask, a position bias) are inputs the
compiled backward keeps; here they live as long as transformers' own references. Autotuning workspaces and the
compiled graph's own small buffers are not modelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memfit.errors import MemfitError

__all__ = ["flex_patches", "check_flex_model", "FLEX_BLOCK_SIZE"]

#: torch/nn/attention/flex_attention.py `_DEFAULT_SPARSE_BLOCK_SIZE` (create_block_mask's BLOCK_SIZE default)
FLEX_BLOCK_SIZE = 128


class _Flex(torch.autograd.Function):
    """The compiled flex attention kernel pair: allocations of the Triton forward and backward templates."""

    @staticmethod
    def forward(ctx, q, k, v, block_mask):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # as FlexAttentionAutogradOp: no zeros for the logsumexp's gradient
        b, hq, sq, _ = q.shape
        out = torch.empty_like(q) if v.shape[-1] == q.shape[-1] else \
            q.new_empty((b, hq, sq, v.shape[-1]))
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        max_scores = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
        del max_scores  # not read by the backward: freed when the compiled forward returns
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block_mask = block_mask  # its tensors are backward inputs: alive until the backward
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        grad_q = torch.empty_like(q)
        grad_k = torch.empty_like(k)
        grad_v = torch.empty_like(v)
        del delta
        ctx.block_mask = None
        return grad_q, grad_k, grad_v, None


def _flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                    kernel_options=None, training=False, return_lse=False, return_aux=None, **_: Any):
    """Stands in for transformers' `compile_friendly_flex_attention` (same arguments)."""
    out, lse = _Flex.apply(query, key, value, block_mask)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=lse if getattr(return_aux, "lse", False) else None)
    if return_lse:
        return out, lse
    return out


def _create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=FLEX_BLOCK_SIZE, _compile=False,
                       separate_full_blocks=True, **_: Any):
    """Stands in for `create_block_mask` (compiled): the kv-side int32 tensors it returns, the rest from the real
    `BlockMask.from_kv_blocks` (see module docstring)."""
    from torch.nn.attention.flex_attention import BlockMask

    b, h = B or 1, H or 1
    qb, kb = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    rows, cols = -(-Q_LEN // qb), -(-KV_LEN // kb)
    dev = device if device is not None else "cpu"
    kv_num = torch.zeros((b, h, rows), dtype=torch.int32, device=dev)
    kv_idx = torch.zeros((b, h, rows, cols), dtype=torch.int32, device=dev)
    full_num = full_idx = None
    if separate_full_blocks:
        full_num = torch.zeros((b, h, rows), dtype=torch.int32, device=dev)
        full_idx = torch.zeros((b, h, rows, cols), dtype=torch.int32, device=dev)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(qb, kb), mask_mod=mask_mod,
                                    seq_lengths=(Q_LEN, KV_LEN))


def check_flex_model(config: Any, task_class: str, name: str) -> None:
    """A MemfitError when the model class has no flex attention (transformers 5.24 modeling_utils
    `_check_and_adjust_attn_implementation` raises a ValueError when `_supports_flex_attn` is False).

    Args:
        config: the model's config.
        task_class: the Auto class of the task (`AutoModelForCausalLM`, ...).
        name: the model's name, for the message.
    """
    import transformers

    try:
        cls = getattr(transformers, task_class)._model_mapping[type(config)]
    except (AttributeError, KeyError):  # no head for this task: the build says so
        return
    if not getattr(cls, "_supports_flex_attn", False):
        raise MemfitError(f"`{name}` ({cls.__name__}) has no flex attention in transformers {transformers.__version__} "
                          "(`_supports_flex_attn` is False); use `--attn sdpa` or `--attn eager`")


@contextlib.contextmanager
def flex_patches(log: list[str] | None = None) -> Iterator[None]:
    """transformers' compiled flex attention and block mask replaced by the emulations (module docstring).

    Args:
        log: receives `flex_attention` for every emulated kernel call.
    """
    import transformers.integrations.flex_attention as hf_flex
    import transformers.masking_utils as mu

    from memfit.sim.patching import patched

    def kernel(*args: Any, **kwargs: Any):
        if log is not None:
            log.append("flex_attention")
        return _flex_attention(*args, **kwargs)

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = type(ALL_ATTENTION_FUNCTIONS)._global_mapping  # utils/generic.py GeneralInterface
    real_forward = mapping["flex_attention"]

    def forward(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("dropout", 0.0) > 0:  # transformers' own check, as a MemfitError
            raise MemfitError(f"`flex_attention` does not support attention dropout (transformers' flex_attention_forward "
                              f"raises); this model trains with dropout `{kwargs['dropout']}`: set the config's "
                              "attention dropout to 0, or use `--attn sdpa`")
        return real_forward(module, query, key, value, attention_mask, **kwargs)

    real_all = mu.fast_all

    def fast_all(tensor):
        # `flex_attention_mask` asks whether the 2D mask is all ones (`tensor.sum() == numel`), which a FakeTensor
        # cannot answer; the simulated batch is padded (its last example one token short: memfit.sim.engine
        # `_make_batch`), so the answer is no, as it is on the real batch
        from torch._subclasses.fake_tensor import FakeTensor

        answer = real_all(tensor)  # allocates what the real comparison allocates (`tensor.sum() == tensor.numel()`)
        return False if isinstance(tensor, FakeTensor) else answer

    with patched(hf_flex, "compile_friendly_flex_attention", kernel), \
            patched(mu, "create_block_mask", _create_block_mask), patched(mu, "fast_all", fast_all):
        mapping["flex_attention"] = forward
        try:
            yield
        finally:
            mapping["flex_attention"] = real_forward

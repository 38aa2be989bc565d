"""Emulate CUDA's CTC loss (``F.ctc_loss``) and the target selection before it, on real or fake CPU tensors.

transformers' ``ForCTCLoss`` (transformers/loss/loss_ctc.py) turns off cuDNN
(``torch.backends.cudnn.flags(enabled=False)``), so on a GPU ``F.ctc_loss`` runs PyTorch's own kernels,
``aten/src/ATen/native/cuda/LossCTC.cu``. Their buffers are sized by host values, the label lengths, which a
FakeTensor does not carry; the CPU kernels (``LossCTC.cpp``) allocate other buffers. This module allocates what
the CUDA path allocates, op by op, from shapes alone (values are garbage: ``new_empty``):

* ``ctc_loss`` (``ctc_loss`` in ``LossCTC.cpp`` with tensor lengths): the lengths are read on the host (a copy to
  the CPU, no device memory), then ``ctc_loss_gpu_template`` allocates ``target_lengths_t``, ``input_lengths_t`` and
  ``tg_batch_offsets`` (B int64 each, freed on return), ``log_alpha`` (B, T, 2 L + 1) and ``neg_log_likelihood`` (B)
  in the dtype of ``log_probs`` (float32: ForCTCLoss upcasts); the autograd node (``_ctc_loss`` in
  tools/autograd/derivatives.yaml) keeps ``log_probs``, ``targets``, ``neg_log_likelihood`` and ``log_alpha`` for the
  backward. ``ctc_loss_impl``'s reductions follow with real ops: ``zero_infinity``'s ``where``; ``mean`` divides by
  the target lengths made on the device (``at::tensor(target_lengths).clamp_min(1)``) and takes the mean;
  ``sum`` sums.
* the backward (``ctc_loss_backward_gpu_template``): the three length tensors again, ``log_beta`` (like
  ``log_alpha``) and ``grad`` (``full_like(log_probs)``, contiguous (T, B, C)); on a "large" problem
  (``2 T + 24 B / 10 + 2 C / 10 > 450``, the file's heuristic) the blank subtrahend is computed with real ops on
  strided views of ``log_alpha`` + ``log_beta`` (a (B, T, L + 1) sum and its ``logsumexp``), and
  ``zero_infinity`` makes a second ``grad`` with ``where``.
* ``masked_select_all``: ``labels.masked_select(mask)`` on CUDA (``masked_select_out_cuda_impl`` in
  aten/src/ATen/native/cuda/IndexKernel.cu: ``index_out`` with the boolean mask, which ``expandTensors`` turns into
  ``mask.nonzero()``) allocates the nonzero indices (n, mask.dim()) int64 and the result (n).

L is the longest target: memfit's batch gives every example a transcript of the same, longest, length (the worst
batch), so L = the selected targets / B and every label position is a target (memfit.sim.engine's CTC batch).

Known limitations: cub's temporary storage inside ``nonzero`` (a few hundred bytes) is not allocated; the device
copies of the host length lists are made in the order the file makes them, freed in the reverse order of their
construction (C++ destructors), which is what the caching allocator sees.
"""

from __future__ import annotations

import torch

__all__ = ["ctc_loss", "masked_select_all", "is_large_problem"]


def is_large_problem(max_input_length: int, batch_size: int, num_labels: int) -> bool:
    """LossCTC.cu `ctc_loss_backward_gpu_template`: "Very crude heuristic for what is a small problem"."""
    return (2 * max_input_length + (24 * batch_size) // 10 + (2 * num_labels) // 10) > 450


def masked_select_all(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`labels.masked_select(mask)` for a mask that selects every position (memfit's CTC labels), allocating what
    CUDA's masked_select allocates: `mask.nonzero()` (n, mask.dim()) int64, freed, and the result (n)."""
    n = labels.numel()
    indices = torch.empty((n, mask.dim()), dtype=torch.long, device=labels.device)
    out = torch.empty(n, dtype=labels.dtype, device=labels.device)
    del indices
    return out


def _lengths_on_device(like: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """`target_lengths_t`, `input_lengths_t` (at::tensor of the host lists) and `tg_batch_offsets.cuda()`, in the
    order the template makes them."""
    return [torch.empty(batch, dtype=torch.long, device=like.device) for _ in range(3)]


def _free_lengths(lengths: list[torch.Tensor]) -> None:
    """The template's locals destroyed in the reverse order of their declaration: input_lengths_t,
    target_lengths_t, then tg_batch_offsets (declared first, on the CPU, then reassigned to its device copy)."""
    for i in (1, 0, 2):
        lengths[i] = None  # type: ignore[call-overload]


class _CtcLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_probs, targets, max_target_length, blank, zero_infinity):  # type: ignore[override]
        T, B, C = log_probs.shape
        lengths = _lengths_on_device(targets, B)
        # ctc_loss_gpu_template: log_alpha {B, T, 2 L + 1} and neg_log_likelihood {B}, log_probs.options()
        log_alpha = log_probs.new_empty((B, T, 2 * max_target_length + 1))
        nll = log_probs.new_empty((B,))
        _free_lengths(lengths)
        ctx.save_for_backward(log_probs, targets, nll, log_alpha)
        ctx.meta = (max_target_length, blank, zero_infinity)
        return nll

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        log_probs, targets, nll, log_alpha = ctx.saved_tensors
        max_target_length, blank, zero_infinity = ctx.meta
        T, B, C = log_probs.shape
        lengths = _lengths_on_device(targets, B)
        log_beta = torch.empty_like(log_alpha, memory_format=torch.contiguous_format)  # then fill_(neginf)
        # full_like(log_probs, neginf): (T, B, C) bytes. Laid out here as the (B, T, C) logits are: the only reader,
        # log_softmax's backward (through the transpose), makes a contiguous grad_input on CUDA and on the CPU
        # whatever the layout (SoftMax.cpp's meta function), but its FakeTensor meta copies the grad's strides,
        # and the view after it would then copy
        grad = log_probs.new_empty((B, T, C)).transpose(0, 1)
        if is_large_problem(T, B, C):
            # at::exp_out(grad, log_probs) writes in place; the blanks' subtrahend:
            # logsumexp(log_alpha[..., ::2] + log_beta[..., ::2], 2, true).permute(1, 0, 2).add_(nll).sub_(lp).exp_()
            strided = (B, T, max_target_length + 1)
            la = log_alpha.as_strided(strided, (log_alpha.stride(0), log_alpha.stride(1), log_alpha.stride(2) * 2))
            lb = log_beta.as_strided(strided, (log_beta.stride(0), log_beta.stride(1), log_beta.stride(2) * 2))
            summed = la + lb
            lse = torch.logsumexp(summed, 2, True)
            del summed
            lse.permute(1, 0, 2).add_(nll.view(1, B, 1)).sub_(log_probs.narrow(2, blank, 1)).exp_()
            grad.narrow(2, blank, 1).sub_(lse.permute(1, 0, 2))
            del lse
            grad.mul_(grad_out.view(1, B, 1))
            if zero_infinity:
                grad = torch.where(nll.view(1, B, 1) == float("inf"), torch.zeros((), dtype=grad.dtype,
                                                                                  device=grad.device), grad)
        del log_beta
        _free_lengths(lengths)
        return grad, None, None, None, None


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, blank: int = 0, reduction: str = "mean",
             zero_infinity: bool = False) -> torch.Tensor:
    """`F.ctc_loss` as CUDA runs it without cuDNN (module docstring), for concatenated (1-D) targets of B equal
    lengths. `input_lengths` / `target_lengths` are device tensors of B values (their host copies allocate
    nothing on the device)."""
    T, B, _ = log_probs.shape
    max_target_length = targets.numel() // max(B, 1)
    res = _CtcLoss.apply(log_probs, targets, max_target_length, blank, zero_infinity)
    # ctc_loss_impl after _ctc_loss
    if zero_infinity:
        res = torch.where(res == float("inf"), torch.zeros((), dtype=res.dtype, device=res.device), res)
    if reduction == "mean":
        lengths = torch.empty(B, dtype=res.dtype, device=res.device)  # at::tensor(target_lengths, res.options())
        lengths = lengths.clamp_min(1)
        return (res / lengths).mean()
    if reduction == "sum":
        return res.sum()
    return res

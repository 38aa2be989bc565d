"""The GPU memory a vLLM engine takes next to GRPO training (TRL 1.16), in closed form: vLLM is modelled, never
imported (it need not be installed).

    from memfit.gpus.vllm import vllm_share
    share = vllm_share(mode="colocate", utilization=0.3, total_bytes=80 * 2**30, sleep=False)
    share.generation_bytes   # 0.3 x 80 GiB, in the training process while it generates
    share.training_bytes     # what vLLM keeps while the training step runs

The rules, and where they come from:

- `vllm_mode="colocate"`: TRL builds `vllm.LLM(..., gpu_memory_utilization=args.vllm_gpu_memory_utilization,
  distributed_executor_backend="external_launcher")` in the training process, on the training GPU
  (trl/generation/vllm_generation.py `VLLMGeneration._init_vllm`). vLLM's `gpu_memory_utilization` is "the
  fraction of GPU memory to be used for the model executor", a per-instance limit on the *total* memory of the
  device (vLLM engine arguments, https://docs.vllm.ai/en/latest/configuration/engine_args/): vLLM loads the
  weights, profiles a forward, and sizes its KV cache pool so that weights + activations + KV cache fill exactly
  `utilization x total`. That share stays allocated for the life of the engine: the training step has what
  remains of the card.
- `vllm_enable_sleep_mode=True`: TRL calls `llm.sleep(level=2)` after building the engine and after each
  generation, `wake_up(tags=["weights"])` before pushing the new weights (after `empty_cache()`), and
  `wake_up(tags=["kv_cache"])` before generating (vllm_generation.py `sync_weights`, `generate`). Level 2
  "discards both the model weights and the KV cache (while the model's buffers are kept in CPU)" (vLLM docs,
  https://docs.vllm.ai/en/latest/features/sleep_mode/): during the training step vLLM's pool holds nothing that
  memfit counts; vLLM's CUDA graphs and NCCL buffers, which sleep mode does not release, are not modelled.
  While it generates the share is back, next to what the training process still holds at that moment
  (weights, optimizer state and the buffered completions; TRL empties PyTorch's cache first).
- `vllm_mode="server"`: `trl vllm-serve` runs vLLM on other GPUs (its `gpu_memory_utilization` default is 0.9,
  trl/scripts/vllm_serve.py `ScriptArguments`); the training GPU holds no vLLM memory, and each generation GPU
  holds `utilization x` its own total.

Known limitations: vLLM's own activations are inside its share (vLLM sizes the pool around them); a share that
does not hold the weights and a minimal KV cache makes vLLM itself fail at start-up ("No available memory for
the cache blocks"): memfit reports it (`weights_fit`) but does not model vLLM's profiling run.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError

__all__ = ["VllmShare", "vllm_share", "VLLM_SLEEP_LEVEL", "VLLM_SERVE_DEFAULT_UTILIZATION", "vllm_serve_max_num_seqs"]

#: trl/generation/vllm_generation.py: `self.llm.sleep(level=2)` (TRL 1.16).
VLLM_SLEEP_LEVEL = 2
#: trl/scripts/vllm_serve.py `ScriptArguments.gpu_memory_utilization` default (TRL 1.16).
VLLM_SERVE_DEFAULT_UTILIZATION = 0.9


def vllm_serve_max_num_seqs(gpu_name: str, total_bytes: int) -> int:
    """Sequences `trl vllm-serve`'s engine schedules at once: trl/scripts/vllm_serve.py (TRL 1.16) passes no
    `--max-num-seqs`, so `vllm serve` takes its default, vllm/engine/arg_utils.py `EngineArgs.get_batch_defaults`
    (UsageContext.OPENAI_API_SERVER): 1024 on a GPU of 70 GiB or more whose name does not contain "a100" (H100,
    H200, MI300x), else 256 (then at most `max_num_batched_tokens`, 8192 / 2048 there: not lower). It caps the
    server's concurrency, not its memory: the KV cache pool is what `gpu_memory_utilization` leaves beside the
    weights whatever the cap. (Colocated, TRL passes `max_num_seqs = per_device_train_batch_size x
    vllm_tensor_parallel_size x steps_per_generation`, the rank's generation batch, grpo_trainer.py: what
    memfit.planner.grpo_time already caps a wave at.)"""
    return 1024 if total_bytes >= 70 * 2**30 and "a100" not in gpu_name.lower() else 256


@dataclass(frozen=True)
class VllmShare:
    """What vLLM takes of the training GPU, by phase. All sizes in bytes."""

    mode: str  #: colocate or server
    utilization: float
    sleep: bool
    generation_bytes: int
    """vLLM's memory on the training GPU while it generates: `utilization x total` colocated, 0 in server mode."""
    training_bytes: int
    """vLLM's memory on the training GPU while the training step runs: the share without sleep mode, 0 with it
    (level 2) or in server mode."""
    weights_bytes: int
    """The weights vLLM loads into its share (the model's weights in their dtype)."""
    kv_pool_bytes: int
    """What the share leaves vLLM for its KV cache and activations: `generation_bytes - weights_bytes` (0 when
    the weights alone do not fit; then vLLM fails at start-up)."""

    @property
    def weights_fit(self) -> bool:
        return self.mode != "colocate" or self.generation_bytes > self.weights_bytes

    def to_json(self) -> dict:
        return {"mode": self.mode, "utilization": self.utilization, "sleep": self.sleep,
                "sleep_level": VLLM_SLEEP_LEVEL if self.sleep else None, "generation_bytes": self.generation_bytes,
                "training_bytes": self.training_bytes, "weights_bytes": self.weights_bytes,
                "kv_pool_bytes": self.kv_pool_bytes, "weights_fit": self.weights_fit}


def vllm_share(*, mode: str, utilization: float, total_bytes: int, sleep: bool, weights_bytes: int = 0) -> VllmShare:
    """vLLM's share of a GPU of `total_bytes` (see the module docstring).

    Args:
        mode: `colocate` (in the training process) or `server` (other GPUs).
        utilization: vLLM's `gpu_memory_utilization`, in (0, 1].
        total_bytes: the training GPU's total memory (what vLLM multiplies by `utilization`).
        sleep: `vllm_enable_sleep_mode`.
        weights_bytes: the weights vLLM loads (for `kv_pool_bytes` and `weights_fit`).
    """
    if mode not in ("colocate", "server"):
        raise MemfitError(f"vllm_mode `{mode}` must be `colocate` or `server`")
    if not 0 < utilization <= 1:
        raise MemfitError(f"vllm_gpu_memory_utilization `{utilization}` must be in (0, 1]")
    if mode == "server":
        return VllmShare(mode, utilization, sleep, 0, 0, weights_bytes, 0)
    share = int(utilization * total_bytes)
    return VllmShare(mode, utilization, sleep, generation_bytes=share, training_bytes=0 if sleep else share,
                     weights_bytes=weights_bytes, kv_pool_bytes=max(0, share - weights_bytes))

"""English and Chinese strings for `memfit diagnose`.

One table, `MESSAGES[key][lang]`, filled with `str.format` fields; `t(key, lang, **fields)`
renders one. Sizes are passed in already formatted (``0.47 GiB``). Every key has both
languages (tests check this); add a language by adding a column.
"""

from __future__ import annotations

from memfit.errors import MemfitError

__all__ = ["LANGS", "MESSAGES", "t"]

LANGS = ("en", "zh")

MESSAGES: dict[str, dict[str, str]] = {
    # ------------------------------------------------------------------ headings
    "title": {"en": "CUDA out-of-memory diagnosis", "zh": "CUDA 显存不足（OOM）诊断"},
    "title.cpu": {"en": "Host memory (RAM) out-of-memory diagnosis", "zh": "主机内存（RAM）不足诊断"},
    "label.message": {"en": "Message", "zh": "错误信息"},
    "label.format": {"en": "Format", "zh": "格式"},
    "label.phase": {"en": "Where", "zh": "发生位置"},
    "label.frame": {"en": "Frame", "zh": "调用帧"},
    "label.numbers": {"en": "Memory (from the message)", "zh": "显存数据（来自错误信息）"},
    "label.causes": {"en": "Why", "zh": "原因"},
    "label.advice": {"en": "What helps (most effective first)", "zh": "解决办法（按效果排序）"},
    "label.gpu_processes": {"en": "Processes holding GPU memory now (NVML)", "zh": "当前占用显存的进程（NVML）"},
    "label.primary": {"en": "main cause", "zh": "主要原因"},
    "num.tried": {"en": "tried to allocate", "zh": "尝试分配"},
    "num.total": {"en": "total capacity", "zh": "总容量"},
    "num.free": {"en": "free on the device", "zh": "设备空闲"},
    "num.allocated": {"en": "allocated by PyTorch (live tensors)", "zh": "PyTorch 已分配（存活张量）"},
    "num.reserved": {"en": "reserved by PyTorch (cache)", "zh": "PyTorch 保留（缓存）"},
    "num.unallocated": {"en": "reserved but unallocated", "zh": "已保留但未分配"},
    "num.non_pytorch": {"en": "outside PyTorch's cache", "zh": "PyTorch 缓存之外"},
    "num.process": {"en": "this process (incl. non-PyTorch)", "zh": "本进程（含非 PyTorch）"},
    "num.allowed": {"en": "allowed (memory fraction)", "zh": "允许上限（memory fraction）"},
    "num.private": {"en": "in private pools (CUDA Graphs)", "zh": "私有内存池（CUDA Graphs）"},
    "count": {
        "en": "{count} out-of-memory errors in the input; this is the last one.",
        "zh": "输入中共有 {count} 个显存不足错误；以下分析最后一个。",
    },
    "no_oom": {
        "en": "No out-of-memory error found in {source}. memfit looks for `CUDA out of memory`, "
        "`CUDA error: out of memory`, CUBLAS/cuDNN allocation failures and `DefaultCPUAllocator`.",
        "zh": "在 {source} 中没有找到显存不足错误。memfit 会查找 `CUDA out of memory`、"
        "`CUDA error: out of memory`、CUBLAS/cuDNN 分配失败以及 `DefaultCPUAllocator`。",
    },
    # ------------------------------------------------------------------ phases
    "phase.forward": {"en": "forward pass", "zh": "前向传播"},
    "phase.backward": {"en": "backward pass", "zh": "反向传播"},
    "phase.optimizer": {"en": "optimizer step", "zh": "优化器更新（optimizer.step）"},
    "phase.evaluation": {"en": "evaluation / prediction loop", "zh": "评估 / 预测循环"},
    "phase.checkpoint_save": {"en": "saving a checkpoint", "zh": "保存检查点"},
    "phase.load_best_model": {"en": "loading the best model at the end of training", "zh": "训练结束时加载最佳模型"},
    "phase.data_collation": {"en": "building the batch (data collation)", "zh": "构建批次（数据整理 collate）"},
    "phase.model_loading": {"en": "loading the model / moving it to the GPU", "zh": "加载模型 / 移动到 GPU"},
    "phase.unknown": {"en": "unknown (no traceback frames)", "zh": "未知（没有调用栈信息）"},
    # ------------------------------------------------------------------ causes
    "cause.fragmentation.significant": {
        "en": "Fragmentation: {unalloc} is reserved by PyTorch but unallocated ({reserved} reserved − "
        "{allocated} allocated, {share} of the cache). The free pieces are split across partly used "
        "segments, so the {tried} request did not fit in any of them.{fits}",
        "zh": "碎片化：有 {unalloc} 已被 PyTorch 保留但未分配（保留 {reserved} − 已分配 {allocated}，"
        "占缓存的 {share}）。这些空闲块分散在部分占用的段中，{tried} 的请求放不进任何一个。{fits}",
    },
    "cause.fragmentation.fits": {
        "en": " Without fragmentation the request would have fit ({unalloc} + {free} free ≥ {tried}).",
        "zh": "若没有碎片，本次请求本可以放下（{unalloc} + 空闲 {free} ≥ {tried}）。",
    },
    "cause.fragmentation.small": {
        "en": "Not fragmentation: only {unalloc} ({reserved} reserved − {allocated} allocated) is reserved "
        "but unallocated, so max_split_size_mb or expandable_segments are not the fix.",
        "zh": "不是碎片问题：只有 {unalloc}（保留 {reserved} − 已分配 {allocated}）是已保留但未分配的，"
        "所以 max_split_size_mb 或 expandable_segments 解决不了。",
    },
    "cause.non_pytorch": {
        "en": "About {bytes} ({total} total − {free} free − {reserved} reserved) is held outside PyTorch's "
        "cache: the CUDA context and loaded kernels, cuDNN, NCCL buffers, other libraries and processes.{extra}",
        "zh": "约 {bytes}（总量 {total} − 空闲 {free} − 保留 {reserved}）在 PyTorch 缓存之外：CUDA 上下文、"
        "已加载的内核、cuDNN、NCCL 缓冲区、其他库和进程。{extra}",
    },
    "cause.non_pytorch.typical": {
        "en": " That is the usual size of a CUDA context and libraries (up to {ctx}); it cannot be freed.",
        "zh": "这是 CUDA 上下文和库的常见占用（最多约 {ctx}），无法释放。",
    },
    "cause.non_pytorch.large": {
        "en": " That is more than a CUDA context needs (up to {ctx}): something else holds GPU memory.",
        "zh": "这超过了 CUDA 上下文的正常需要（最多约 {ctx}）：还有别的东西占用了显存。",
    },
    "cause.non_pytorch.windows": {
        "en": "PyTorch reserved more ({reserved}) than the card has free after the driver ({total} total, "
        "{free} free): on Windows the driver spills into shared system memory, which is slow.",
        "zh": "PyTorch 保留的显存（{reserved}）超过了显卡容量（总量 {total}，空闲 {free}）：Windows 驱动"
        "正在使用共享系统内存，速度很慢。",
    },
    "cause.other_processes": {
        "en": "Other processes hold {bytes} on this GPU: {processes}.",
        "zh": "其他进程在这块 GPU 上占用了 {bytes}：{processes}。",
    },
    "cause.self_pid": {
        "en": "Process {pid} ({bytes}) is most likely this process itself: inside a container NVML "
        "reports a different PID, so PyTorch did not recognise it.",
        "zh": "进程 {pid}（{bytes}）很可能就是本进程：在容器中 NVML 报告的 PID 不同，PyTorch 没能识别。",
    },
    "cause.memory_cap": {
        "en": "PyTorch is capped at {allowed} (set_per_process_memory_fraction or "
        "PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction) while {free} is still free on the device.",
        "zh": "PyTorch 被限制在 {allowed}（set_per_process_memory_fraction 或 "
        "PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction），而设备上仍有 {free} 空闲。",
    },
    "cause.shortfall": {
        "en": "True shortfall: the step needed at least {bytes} more than the GPU had ({tried} requested, "
        "{free} free). Live tensors occupy {allocated} of {total} ({share}); the step's peak is "
        "usually higher than the failed request.",
        "zh": "显存确实不够：这一步至少还需要 {bytes}（请求 {tried}，空闲 {free}）。存活张量占用了 "
        "{total} 中的 {allocated}（{share}）；这一步的峰值通常比失败的这次请求更大。",
    },
    "cause.shortfall.full": {
        "en": "True shortfall: the GPU is full. {tried} was requested with {free} free, too little for a new "
        "segment (cudaMalloc works in 2 MiB pages, the allocator in 2 MiB / 20 MiB segments). Live "
        "tensors occupy {allocated} of {total} ({share}).",
        "zh": "显存确实不够：GPU 已满。请求 {tried}，空闲只有 {free}，不足以分配新的段（cudaMalloc 以 2 MiB "
        "页为单位，分配器以 2 MiB / 20 MiB 段为单位）。存活张量占用了 {total} 中的 {allocated}（{share}）。",
    },
    "cause.no_numbers.cuda_error": {
        "en": "`CUDA error: out of memory` comes from a CUDA call outside PyTorch's caching allocator "
        "(CUDA context creation, a library, a kernel launch), so it has no figures. The GPU was already "
        "full or held by another process.",
        "zh": "`CUDA error: out of memory` 来自 PyTorch 缓存分配器之外的 CUDA 调用（创建 CUDA 上下文、"
        "某个库或内核启动），因此没有具体数字。GPU 当时已满或被其他进程占用。",
    },
    "cause.no_numbers.cublas_alloc_failed": {
        "en": "cuBLAS could not allocate its handle/workspace (CUBLAS_STATUS_ALLOC_FAILED): the GPU was "
        "already full when the first matrix multiply ran, or another process holds the memory.",
        "zh": "cuBLAS 无法分配句柄/工作区（CUBLAS_STATUS_ALLOC_FAILED）：第一次矩阵乘法时 GPU 已满，"
        "或显存被其他进程占用。",
    },
    "cause.no_numbers.cudnn_alloc_failed": {
        "en": "cuDNN could not allocate its workspace (CUDNN_STATUS_ALLOC_FAILED): the GPU was already full.",
        "zh": "cuDNN 无法分配工作区（CUDNN_STATUS_ALLOC_FAILED）：GPU 已满。",
    },
    "cause.no_numbers.cudnn_not_supported": {
        "en": "CUDNN_STATUS_NOT_SUPPORTED is often a batch too large for cuDNN's kernels (memory), but can "
        "also be a non-contiguous input; this is not certainly an out-of-memory error.",
        "zh": "CUDNN_STATUS_NOT_SUPPORTED 常见原因是批次对 cuDNN 内核来说太大（显存），也可能是输入不连续；"
        "不一定是显存不足。",
    },
    "cause.no_numbers.truncated": {
        "en": "The message was cut before its figures (a logger, UI or the pytorch#123984 device-index bug "
        "truncated it); only the request size {tried} is known.",
        "zh": "错误信息在数字之前被截断（日志、界面或 pytorch#123984 设备编号问题导致）；只知道请求大小 {tried}。",
    },
    "cause.cpu": {
        "en": "Host RAM ran out, not GPU memory: a {tried} allocation on the CPU failed.",
        "zh": "耗尽的是主机内存（RAM），不是显存：CPU 上 {tried} 的分配失败了。",
    },
    # ------------------------------------------------------------------ advice
    "advice.expandable_segments": {
        "en": "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment before Python starts, "
        "so the allocator grows segments instead of leaving unusable gaps.",
        "zh": "在启动 Python 之前设置环境变量 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True，"
        "让分配器扩展段而不是留下无法使用的空隙。",
    },
    "advice.stop_other_processes": {
        "en": "Stop the other processes on this GPU ({pids}) or use another GPU; see them with "
        "`nvidia-smi --query-compute-apps=pid,used_memory --format=csv`.",
        "zh": "停止这块 GPU 上的其他进程（{pids}）或换一块 GPU；可用 "
        "`nvidia-smi --query-compute-apps=pid,used_memory --format=csv` 查看。",
    },
    "advice.check_nvidia_smi": {
        "en": "Check `nvidia-smi` for other processes (a second run, a notebook kernel, DataLoader workers "
        "that touch CUDA) and stop them; do not create CUDA tensors in DataLoader workers.",
        "zh": "用 `nvidia-smi` 检查其他进程（另一个训练、Notebook 内核、使用 CUDA 的 DataLoader worker）"
        "并停止它们；不要在 DataLoader worker 中创建 CUDA 张量。",
    },
    "advice.raise_cap": {
        "en": "Raise or remove the memory cap (torch.cuda.set_per_process_memory_fraction or "
        "per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF).",
        "zh": "提高或取消显存上限（torch.cuda.set_per_process_memory_fraction 或 "
        "PYTORCH_CUDA_ALLOC_CONF 中的 per_process_memory_fraction）。",
    },
    "advice.shorter_sequences": {
        "en": "Use shorter sequences: lower max_length / max_seq_length, and pad per batch "
        "(padding='longest', group_by_length=True) so padding does not inflate activations.",
        "zh": "缩短序列：降低 max_length / max_seq_length，并按批次填充（padding='longest'、"
        "group_by_length=True），避免填充放大激活值。",
    },
    "advice.gradient_checkpointing": {
        "en": "Turn on gradient checkpointing (TrainingArguments(gradient_checkpointing=True) or "
        "model.gradient_checkpointing_enable()): activations are recomputed in the backward pass for "
        "about 30% more compute. XLNet has none in transformers 5; memfit provides it.",
        "zh": "开启梯度检查点（TrainingArguments(gradient_checkpointing=True) 或 "
        "model.gradient_checkpointing_enable()）：反向传播时重新计算激活值，约多 30% 计算量。"
        "transformers 5 中 XLNet 不支持，memfit 提供了实现。",
    },
    "advice.micro_batch": {
        "en": "Halve per_device_train_batch_size and double gradient_accumulation_steps: the effective batch "
        "(batch × accumulation × GPUs) and the results stay the same.",
        "zh": "将 per_device_train_batch_size 减半并将 gradient_accumulation_steps 加倍："
        "有效批次（批次 × 累积步数 × GPU 数）和训练结果保持不变。",
    },
    "advice.optimizer_8bit": {
        "en": "Use a smaller optimizer state: optim='adamw_bnb_8bit' (bitsandbytes) or optim='adafactor'. "
        "AdamW keeps two fp32 states per trainable parameter (8 bytes each).",
        "zh": "使用更小的优化器状态：optim='adamw_bnb_8bit'（bitsandbytes）或 optim='adafactor'。"
        "AdamW 为每个可训练参数保存两个 fp32 状态（每个参数 8 字节）。",
    },
    "advice.lora": {
        "en": "Train a LoRA adapter (peft) instead of all weights: gradients and optimizer state shrink to "
        "the adapter's size.",
        "zh": "用 LoRA 适配器（peft）代替全参数训练：梯度和优化器状态缩小到适配器的规模。",
    },
    "advice.eval_batch_size": {
        "en": "Lower per_device_eval_batch_size (it is set separately from the training batch size).",
        "zh": "降低 per_device_eval_batch_size（它与训练批次大小是分开设置的）。",
    },
    "advice.eval_accumulation_steps": {
        "en": "Set eval_accumulation_steps (e.g. 8) so predictions move to the CPU every few steps instead "
        "of piling up on the GPU.",
        "zh": "设置 eval_accumulation_steps（例如 8），让预测结果每隔几步转移到 CPU，而不是堆积在 GPU 上。",
    },
    "advice.preprocess_logits": {
        "en": "Pass preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1) to the Trainer so "
        "full-vocabulary logits (batch × sequence × vocabulary) are not kept.",
        "zh": "给 Trainer 传入 preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1)，"
        "避免保存完整词表的 logits（批次 × 序列 × 词表）。",
    },
    "advice.save_only_model": {
        "en": "Saving copies state to the CPU while training state is still on the GPU: set "
        "save_only_model=True (skip optimizer state), call torch.cuda.empty_cache() before saving, and "
        "with FSDP use a sharded state dict.",
        "zh": "保存时训练状态仍在 GPU 上：设置 save_only_model=True（不保存优化器状态），保存前调用 "
        "torch.cuda.empty_cache()，使用 FSDP 时采用分片的 state dict。",
    },
    "advice.load_best_fresh": {
        "en": "Loading the best checkpoint happens while weights, gradients and optimizer state are still "
        "on the GPU: set load_best_model_at_end=False and load the best checkpoint in a fresh process, or "
        "free the optimizer first (del trainer.optimizer; torch.cuda.empty_cache()).",
        "zh": "加载最佳检查点时，权重、梯度和优化器状态仍在 GPU 上：设置 load_best_model_at_end=False，"
        "在新进程中加载最佳检查点，或先释放优化器（del trainer.optimizer; torch.cuda.empty_cache()）。",
    },
    "advice.smaller_model_load": {
        "en": "The weights alone do not fit: load in bf16 (dtype=torch.bfloat16), quantize to 4/8 bit "
        "(bitsandbytes, QLoRA), or use device_map='auto' to offload layers to the CPU.",
        "zh": "仅权重就放不下：以 bf16 加载（dtype=torch.bfloat16），量化为 4/8 位（bitsandbytes、QLoRA），"
        "或使用 device_map='auto' 将部分层卸载到 CPU。",
    },
    "advice.collator_cpu": {
        "en": "Build batches on the CPU (no .cuda() in the collator or dataset), pad to the longest sequence "
        "in the batch, and cap max_length.",
        "zh": "在 CPU 上构建批次（collator 或 dataset 中不要调用 .cuda()），按批次内最长序列填充，并限制 max_length。",
    },
    "advice.cpu_ram": {
        "en": "Reduce host memory: fewer dataloader_num_workers, streaming datasets, "
        "low_cpu_mem_usage=True / device_map when loading, smaller tensors on the CPU, or more RAM/swap.",
        "zh": "减少主机内存占用：减少 dataloader_num_workers，使用流式数据集，加载时使用 "
        "low_cpu_mem_usage=True / device_map，减小 CPU 上的张量，或增加内存/交换空间。",
    },
    "advice.cuda_launch_blocking": {
        "en": "Rerun with CUDA_LAUNCH_BLOCKING=1 so the traceback points at the operation that failed.",
        "zh": "使用 CUDA_LAUNCH_BLOCKING=1 重新运行，使调用栈指向真正失败的操作。",
    },
    "advice.cudnn_check": {
        "en": "Try a smaller batch; if it persists, make the input contiguous (.contiguous()) or set "
        "torch.backends.cudnn.enabled=False to confirm cuDNN is the cause.",
        "zh": "尝试更小的批次；如果仍然出错，将输入变为连续（.contiguous()），或设置 "
        "torch.backends.cudnn.enabled=False 以确认是否为 cuDNN 的问题。",
    },
}


def t(key: str, lang: str = "en", /, **fields: object) -> str:
    """The string `key` in `lang` with `fields` filled in."""
    if lang not in LANGS:
        raise MemfitError(f"language `{lang}` is not supported; use one of {', '.join(LANGS)}")
    return MESSAGES[key][lang].format(**fields)

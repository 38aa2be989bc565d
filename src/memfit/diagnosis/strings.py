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
    "title.rocm": {"en": "ROCm (HIP) out-of-memory diagnosis", "zh": "ROCm（HIP）显存不足诊断"},
    "title.xpu": {"en": "Intel XPU out-of-memory diagnosis", "zh": "英特尔 XPU 显存不足诊断"},
    "title.mps": {"en": "Apple MPS out-of-memory diagnosis", "zh": "Apple MPS 内存不足诊断"},
    "unknown": {"en": "unknown (not in the message)", "zh": "未知（信息中没有）"},
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
    "num.mps_allocated": {"en": "MPS allocated (PyTorch's heaps)", "zh": "MPS 已分配（PyTorch 的堆）"},
    "num.mps_other": {"en": "other Metal allocations of this process", "zh": "本进程的其他 Metal 分配"},
    "num.mps_allowed": {"en": "max allowed (high watermark)", "zh": "允许上限（high watermark）"},
    "count": {
        "en": "{count} out-of-memory errors in the input; this is the last one.",
        "zh": "输入中共有 {count} 个显存不足错误；以下分析最后一个。",
    },
    "no_oom": {
        "en": "No out-of-memory error found in {source}. memfit looks for `CUDA out of memory`, "
        "`HIP out of memory`, `XPU out of memory`, `MPS backend out of memory`, `CUDA error: out of memory`, "
        "CUBLAS/cuDNN allocation failures and `DefaultCPUAllocator`.",
        "zh": "在 {source} 中没有找到显存不足错误。memfit 会查找 `CUDA out of memory`、`HIP out of memory`、"
        "`XPU out of memory`、`MPS backend out of memory`、`CUDA error: out of memory`、"
        "CUBLAS/cuDNN 分配失败以及 `DefaultCPUAllocator`。",
    },
    # ------------------------------------------------------------------ phases
    "phase.forward": {"en": "forward pass", "zh": "前向传播"},
    "phase.backward": {"en": "backward pass", "zh": "反向传播"},
    "phase.optimizer": {"en": "optimizer step", "zh": "优化器更新（optimizer.step）"},
    "phase.eval": {"en": "evaluation / prediction loop", "zh": "评估 / 预测循环"},
    "phase.save": {"en": "saving a checkpoint", "zh": "保存检查点"},
    "phase.load_best": {"en": "loading the best model at the end of training", "zh": "训练结束时加载最佳模型"},
    "phase.resume": {"en": "resuming from a checkpoint (loading its weights and optimizer state)",
                     "zh": "从检查点恢复训练（加载其权重和优化器状态）"},
    "phase.data_collation": {"en": "building the batch (data collation)", "zh": "构建批次（数据整理 collate）"},
    "phase.model_loading": {"en": "loading the model / moving it to the GPU", "zh": "加载模型 / 移动到 GPU"},
    "phase.unknown": {"en": "unknown (no traceback frames)", "zh": "未知（没有调用栈信息）"},
    # ------------------------------------------------------------------ operations (memfit.diagnosis.operations)
    "label.operation": {"en": "Operation", "zh": "操作"},
    "label.operation_context": {"en": "inside", "zh": "所在调用"},
    "operation.lm_loss": {"en": "loss / log-probabilities over the vocabulary (B × S × V logits)",
                          "zh": "在整个词表上计算损失 / 对数概率（B × S × V 的 logits）"},
    "operation.lm_head": {"en": "the LM head producing the logits (B × S × V)", "zh": "LM head 生成 logits（B × S × V）"},
    "operation.attention_scores": {"en": "eager attention materialising the S × S score matrix",
                                   "zh": "eager 注意力生成 S × S 的注意力分数矩阵"},
    "operation.attention_sdpa": {"en": "scaled_dot_product_attention (SDPA)", "zh": "scaled_dot_product_attention（SDPA）"},
    "operation.bnb_dequant": {"en": "bitsandbytes dequantizing a quantized weight", "zh": "bitsandbytes 反量化权重"},
    "operation.kbit_prep": {"en": "peft prepare_model_for_kbit_training casting to float32",
                            "zh": "peft prepare_model_for_kbit_training 转换为 float32"},
    "operation.dpo_reference": {"en": "the DPO reference model's forward pass", "zh": "DPO 参考模型的前向传播"},
    "operation.generation": {"en": "text generation (KV cache)", "zh": "文本生成（KV 缓存）"},
    "operation.fsdp_unshard": {"en": "FSDP all-gathering (unsharding) parameters", "zh": "FSDP 全收集（unshard）参数"},
    "operation.zero3_fetch": {"en": "DeepSpeed ZeRO-3 fetching (all-gathering) parameters",
                              "zh": "DeepSpeed ZeRO-3 获取（全收集）参数"},
    "operation.zero_buckets": {"en": "DeepSpeed ZeRO gradient reduction buckets", "zh": "DeepSpeed ZeRO 梯度归约桶"},
    "operation.collective": {"en": "a torch.distributed collective's output buffer", "zh": "torch.distributed 集合通信的输出缓冲区"},
    "operation.nccl": {"en": "NCCL's own buffers (outside PyTorch's allocator)", "zh": "NCCL 自身的缓冲区（在 PyTorch 分配器之外）"},
    "operation.unknown": {"en": "unknown (no frame memfit recognises)", "zh": "未知（没有 memfit 能识别的调用帧）"},
    "operation.lm_loss.why": {
        "en": "What allocated: the loss over the vocabulary. transformers' ForCausalLMLoss upcasts the logits to "
        "float32 (loss_utils.py `logits = logits.float()`) and cross-entropy / log-softmax allocates another "
        "tensor of the same size: batch × sequence × vocabulary × 4 bytes each, which dominates memory for "
        "128k-256k vocabularies (Llama 3, Gemma, Qwen3).",
        "zh": "分配来源：在整个词表上计算损失。transformers 的 ForCausalLMLoss 会把 logits 转为 float32"
        "（loss_utils.py `logits = logits.float()`），交叉熵 / log-softmax 还会再分配同样大小的张量：每个都是"
        "批次 × 序列 × 词表 × 4 字节，对 128k-256k 的词表（Llama 3、Gemma、Qwen3）这是显存的大头。",
    },
    "operation.lm_head.why": {
        "en": "What allocated: the LM head, which turns hidden states into logits of batch × sequence × "
        "vocabulary; with a large vocabulary this one tensor can be several GiB.",
        "zh": "分配来源：LM head 把隐藏状态变成 批次 × 序列 × 词表 的 logits；词表很大时这一个张量就可达数 GiB。",
    },
    "operation.attention_scores.why": {
        "en": "What allocated: eager attention, which materialises the batch × heads × S × S score matrix "
        "(`torch.matmul(query, key.transpose(...))`, then a float32 softmax): it grows with the square of the "
        "sequence length.",
        "zh": "分配来源：eager 注意力会生成 批次 × 头数 × S × S 的注意力分数矩阵（`torch.matmul(query, key.transpose(...))`，"
        "再做 float32 softmax）：它随序列长度的平方增长。",
    },
    "operation.attention_sdpa.why": {
        "en": "What allocated: scaled_dot_product_attention. Its flash and memory-efficient kernels keep no S × S "
        "matrix, but with an arbitrary mask, dropout or an unsupported dtype / GPU it falls back to the math "
        "kernel, which does.",
        "zh": "分配来源：scaled_dot_product_attention。它的 flash 和 memory-efficient 内核不保存 S × S 矩阵，"
        "但在任意掩码、dropout 或不支持的数据类型 / GPU 上会退回到 math 内核，而 math 内核会生成该矩阵。",
    },
    "operation.bnb_dequant.why": {
        "en": "What allocated: bitsandbytes dequantizing a 4-bit / 8-bit weight for a matmul. The backward pass "
        "rebuilds each quantized layer's whole weight in the compute dtype (autograd/_functions.py MatMul4Bit.backward: "
        "`F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)`), and so does the forward pass for large batches "
        "(bitsandbytes 0.50 backends/cuda/ops.py _dequant_linear_fallback; always in older versions); with "
        "transformers' default bnb_4bit_compute_dtype (float32) that is 4 bytes per weight.",
        "zh": "分配来源：bitsandbytes 为矩阵乘法把 4 位 / 8 位权重反量化。反向传播会以计算精度重建每个量化层的整层权重"
        "（autograd/_functions.py MatMul4Bit.backward：`F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)`），"
        "大批次时前向传播也是如此（bitsandbytes 0.50 backends/cuda/ops.py _dequant_linear_fallback；更早的版本总是如此）；"
        "transformers 默认的 bnb_4bit_compute_dtype（float32）下每个权重 4 字节。",
    },
    "operation.kbit_prep.why": {
        "en": "What allocated: peft's prepare_model_for_kbit_training, which casts every float16 / bfloat16 "
        "parameter that is not 4-bit (embeddings, norms, the LM head) to float32 (peft/utils/other.py "
        "`param.data = param.data.to(torch.float32)`): twice their memory, at load time.",
        "zh": "分配来源：peft 的 prepare_model_for_kbit_training 会把所有非 4 位的 float16 / bfloat16 参数"
        "（嵌入层、归一化层、LM head）转成 float32（peft/utils/other.py `param.data = param.data.to(torch.float32)`）："
        "加载时它们的显存翻倍。",
    },
    "operation.dpo_reference.why": {
        "en": "What allocated: the DPO reference model's forward pass (TRL DPOTrainer: `self.ref_model(...)`, or the "
        "peft model with its adapter disabled), which runs on every batch next to the policy model.",
        "zh": "分配来源：DPO 参考模型的前向传播（TRL DPOTrainer：`self.ref_model(...)`，或禁用适配器的 peft 模型），"
        "它在每个批次上与策略模型一起运行。",
    },
    "operation.generation.why": {
        "en": "What allocated: generation inside training or evaluation (generate / _sample; TRL GRPO's "
        "completions, predict_with_generate). The KV cache holds 2 × layers × sequences × KV heads × tokens × "
        "head size values and grows with every generated token.",
        "zh": "分配来源：训练或评估中的文本生成（generate / _sample；TRL GRPO 的补全、predict_with_generate）。"
        "KV 缓存保存 2 × 层数 × 序列数 × KV 头数 × token 数 × 头维度 个值，并随每个生成的 token 增长。",
    },
    "operation.fsdp_unshard.why": {
        "en": "What allocated: FSDP all-gathering a unit's full parameters (unshard / foreach_all_gather). "
        "While a unit computes, its whole unsharded weights are on every GPU, plus the next unit's when "
        "prefetching.",
        "zh": "分配来源：FSDP 全收集某个单元的完整参数（unshard / foreach_all_gather）。一个单元计算时，"
        "它的完整参数在每块 GPU 上，预取时还要加上下一个单元的参数。",
    },
    "operation.zero3_fetch.why": {
        "en": "What allocated: DeepSpeed ZeRO-3 fetching a submodule's parameters (fetch_sub_module -> "
        "all-gather). Up to stage3_max_live_parameters gathered parameters stay on the GPU, and "
        "stage3_prefetch_bucket_size more are fetched ahead.",
        "zh": "分配来源：DeepSpeed ZeRO-3 获取子模块的参数（fetch_sub_module -> 全收集）。GPU 上最多保留 "
        "stage3_max_live_parameters 个已收集的参数，并提前获取 stage3_prefetch_bucket_size 个。",
    },
    "operation.zero_buckets.why": {
        "en": "What allocated: DeepSpeed ZeRO's gradient buckets (stage_1_and_2.py reduce_ipg_grads / "
        "average_tensor): buffers of reduce_bucket_size and allgather_bucket_size elements.",
        "zh": "分配来源：DeepSpeed ZeRO 的梯度桶（stage_1_and_2.py reduce_ipg_grads / average_tensor）："
        "大小为 reduce_bucket_size 和 allgather_bucket_size 个元素的缓冲区。",
    },
    "operation.collective.why": {
        "en": "What allocated: a torch.distributed collective's output (an all_gather returns world size × its "
        "input).",
        "zh": "分配来源：torch.distributed 集合通信的输出（all_gather 返回的是输入的 world size 倍）。",
    },
    "operation.nccl.why": {
        "en": "What allocated: NCCL itself (communicator buffers, channels, proxies), with cudaMalloc outside "
        "PyTorch's caching allocator, so PyTorch's cache could not make room for it.",
        "zh": "分配来源：NCCL 自身（通信器缓冲区、通道、代理），它在 PyTorch 缓存分配器之外调用 cudaMalloc，"
        "所以 PyTorch 的缓存无法为它腾出空间。",
    },
    "cause.no_numbers.nccl": {
        "en": "NCCL ran out of GPU memory (`Cuda failure 'out of memory'`) allocating {tried} for its own "
        "buffers: the GPU was already full of this process's PyTorch cache, other processes or other "
        "communicators. NCCL prints no allocator figures.",
        "zh": "NCCL 在为自身缓冲区分配 {tried} 时显存不足（`Cuda failure 'out of memory'`）：GPU 已经被本进程的 "
        "PyTorch 缓存、其他进程或其他通信器占满。NCCL 不输出分配器数据。",
    },
    "cause.logits": {
        "en": "The failed {tried} request is exactly one logits tensor of {tokens} tokens × {vocab} vocabulary × "
        "{per} bytes ({dtype}), as the run's batch size, sequence length and the model's vocab_size give.",
        "zh": "失败的 {tried} 请求正好是一个 logits 张量：{tokens} 个 token × 词表 {vocab} × {per} 字节（{dtype}），"
        "与本次训练的批次大小、序列长度和模型的 vocab_size 一致。",
    },
    # ------------------------------------------------------------------ causes
    "cause.fragmentation.fits": {
        "en": "Fragmentation: {unalloc} sits unused in PyTorch's cache ({reserved} reserved − {allocated} "
        "allocated, {share_unalloc} of the cache) and {free} is free on the device: together at least the {tried} "
        "request, yet no single piece was that large. PyTorch searches its cache before it asks the driver, and "
        "when it gives up every whole free segment has already gone back to the driver, so the unused cache lies "
        "in pieces of partly used segments, none of them large enough for this request, and the device could give "
        "at most {free}. Without fragmentation this allocation would have fit.",
        "zh": "碎片化：PyTorch 缓存中有 {unalloc} 未被使用（保留 {reserved} − 已分配 {allocated}，占缓存的 "
        "{share_unalloc}），设备上还有 {free} 空闲：两者合计不少于 {tried} 的请求，却没有一块足够大。PyTorch "
        "先在缓存中查找，再向驱动申请；放弃时所有完整的空闲段都已归还驱动，所以剩下的未用缓存分散在部分占用的段中，"
        "没有一块足以满足这次请求，而设备最多只能给出 {free}。如果没有碎片，这次分配本可以成功。",
    },
    "cause.fragmentation.fits_full": {
        "en": "Fragmentation decided this allocation, not the run: {unalloc} sits unused in PyTorch's cache "
        "({reserved} reserved − {allocated} allocated, only {share_unalloc} of the cache) and {free} is free on the "
        "device; together they cover the {tried} request, yet no single piece was that large, so this allocation "
        "would have fit unfragmented. But the card is effectively full: live tensors hold {allocated} of {total} "
        "({share}), and defragmenting (expandable_segments, max_split_size_mb) buys at most those {unalloc}, "
        "enough for this request and not for what the step allocates after it.",
        "zh": "碎片化决定了这一次分配，而不是整个训练：PyTorch 缓存中有 {unalloc} 未被使用（保留 {reserved} − "
        "已分配 {allocated}，仅占缓存的 {share_unalloc}），设备上还有 {free} 空闲；两者合计足以满足 {tried} 的请求，"
        "却没有一块足够大，所以没有碎片时这次分配本可以成功。但这块卡实际上已经满了：存活张量占用了 {total} 中的 "
        "{allocated}（{share}），消除碎片（expandable_segments、max_split_size_mb）最多只能多出这 {unalloc}，"
        "够这一次请求，却不够这一步之后的分配。",
    },
    "cause.fragmentation.fits_cache": {
        "en": "Fragmentation: {unalloc} sits unused in PyTorch's cache ({reserved} reserved − {allocated} allocated), "
        "more than the {tried} request, yet no piece was that large (PyTorch searches its cache first). The message "
        "does not print the free memory, but the unused cache alone would have covered the request unfragmented.",
        "zh": "碎片化：PyTorch 缓存中有 {unalloc} 未被使用（保留 {reserved} − 已分配 {allocated}），超过 {tried} "
        "的请求，却没有一块足够大（PyTorch 先查找缓存）。错误信息没有给出空闲显存，但仅未用缓存本身在没有碎片时"
        "就足以满足请求。",
    },
    "cause.fragmentation.small_pool": {
        "en": "Fragmentation cannot be told here: the failed request is a small tensor (at most 1 MiB), for which "
        "PyTorch asked the driver for a new 2 MiB small-pool segment. Small requests are served only from the small "
        "pool, and none of its free pieces was large enough; the message does not say how much of the {unalloc} "
        "unused cache ({share_unalloc} of {reserved}) is in the small pool. max_split_size_mb does not apply (it "
        "only stops large blocks from being split).",
        "zh": "这里无法判断是否为碎片：失败的请求是一个小张量（最多 1 MiB），PyTorch 为它向驱动申请一个新的 2 MiB "
        "小内存池段。小请求只从小内存池分配，而小池中没有足够大的空闲块；错误信息没有说明 {unalloc} 未用缓存"
        "（占 {reserved} 的 {share_unalloc}）中有多少在小池里。max_split_size_mb 不适用（它只阻止大块被切分）。",
    },
    "cause.fragmentation.contributes": {
        "en": "Fragmentation contributes: {unalloc} is reserved by PyTorch but unallocated ({share_unalloc} of "
        "{reserved}), but even unfragmented the request would not have fit ({unalloc} + {free} free < {tried}).",
        "zh": "碎片化有一定影响：有 {unalloc} 已被 PyTorch 保留但未分配（占 {reserved} 的 {share_unalloc}），"
        "但即使没有碎片，请求也放不下（{unalloc} + 空闲 {free} < {tried}）。",
    },
    "cause.fragmentation.small": {
        "en": "Not fragmentation: only {unalloc} ({reserved} reserved − {allocated} allocated) is reserved but "
        "unallocated, and {unalloc} + {free} free < the {tried} request, so max_split_size_mb or "
        "expandable_segments are not the fix.",
        "zh": "不是碎片问题：只有 {unalloc}（保留 {reserved} − 已分配 {allocated}）是已保留但未分配的，"
        "而 {unalloc} + 空闲 {free} < 请求的 {tried}，所以 max_split_size_mb 或 expandable_segments 解决不了。",
    },
    "cause.fragmentation.headroom": {
        "en": "Not fragmentation: the {free} free already covered the {tried} request, only with too little to spare, "
        "and the {unalloc} unused in PyTorch's cache is less than the request, so no cached piece could have "
        "served it.",
        "zh": "不是碎片问题：空闲的 {free} 本已覆盖 {tried} 的请求，只是余量太少；而 PyTorch 缓存中未用的 {unalloc} "
        "少于请求，没有任何缓存块能满足它。",
    },
    "cause.fragmentation.exceeds_total": {
        "en": "Fragmentation does not matter here: {unalloc} is reserved but unallocated, and no arrangement of "
        "memory fits a request larger than the whole device.",
        "zh": "这里与碎片无关：有 {unalloc} 已保留但未分配，但任何内存布局都放不下比整个设备还大的请求。",
    },
    "cause.fragmentation.moot": {
        "en": "Fragmentation does not explain it: {free} free on the device already exceeds the {tried} request, so "
        "the allocator could have taken a new segment whatever its {unalloc} of unused cache looked like.",
        "zh": "碎片化解释不了：设备上的 {free} 空闲已超过 {tried} 的请求，无论 {unalloc} 的未用缓存如何分布，"
        "分配器都可以申请一个新段。",
    },
    "cause.fragmentation.unknown": {
        "en": "Fragmentation cannot be judged: {unalloc} is reserved but unallocated, less than the {tried} request, "
        "and the message does not print the free memory it would add to.",
        "zh": "无法判断碎片化：有 {unalloc} 已保留但未分配，少于 {tried} 的请求，而错误信息没有给出可与之相加的空闲显存。",
    },
    "cause.fragmentation.mps": {
        "en": "Fragmentation is unknown: the MPS message does not print how much of the {mps} the allocator holds is "
        "unused.",
        "zh": "碎片情况未知：MPS 的错误信息没有给出分配器持有的 {mps} 中有多少未被使用。",
    },
    "cause.non_pytorch": {
        "en": "About {bytes} ({total} total − {free} free − {reserved} reserved) is held outside PyTorch's "
        "cache: the CUDA context and loaded kernels, cuDNN, NCCL buffers, other libraries and processes.{extra}",
        "zh": "约 {bytes}（总量 {total} − 空闲 {free} − 保留 {reserved}）在 PyTorch 缓存之外：CUDA 上下文、"
        "已加载的内核、cuDNN、NCCL 缓冲区、其他库和进程。{extra}",
    },
    "cause.non_pytorch.split": {
        "en": " Of it, {own} is in this process outside its cache (its {process} in use − {reserved} reserved) and "
        "{foreign} elsewhere.",
        "zh": "其中 {own} 属于本进程但在其缓存之外（本进程占用 {process} − 保留 {reserved}），{foreign} 在别处。",
    },
    "cause.non_pytorch.typical": {
        "en": " That is the usual size of a CUDA context and libraries (up to {ctx}); it cannot be freed.",
        "zh": "这是 CUDA 上下文和库的常见占用（最多约 {ctx}），无法释放。",
    },
    "cause.non_pytorch.large": {
        "en": " That is more than a CUDA context needs (up to {ctx}): something else holds GPU memory.",
        "zh": "这超过了 CUDA 上下文的正常需要（最多约 {ctx}）：还有别的东西占用了显存。",
    },
    "cause.non_pytorch.own_large": {
        "en": " This process itself holds more outside its cache than a bare CUDA context (up to {ctx}): NCCL "
        "buffers, cuBLAS/cuDNN workspaces or another library's allocations.",
        "zh": "本进程自身在缓存之外占用的显存超过了单纯的 CUDA 上下文（最多约 {ctx}）：NCCL 缓冲区、"
        "cuBLAS/cuDNN 工作区或其他库的分配。",
    },
    "cause.non_pytorch.windows": {
        "en": "PyTorch reserved more ({reserved}) than the card has free after the driver ({total} total, "
        "{free} free): on Windows the driver spills into shared system memory, which is slow.",
        "zh": "PyTorch 保留的显存（{reserved}）超过了显卡容量（总量 {total}，空闲 {free}）：Windows 驱动"
        "正在使用共享系统内存，速度很慢。",
    },
    "cause.non_pytorch.negative": {
        "en": "The figures do not add up: PyTorch reserved {reserved}, more than the {total} capacity minus the "
        "{free} free, so the memory outside PyTorch's cache cannot be computed.",
        "zh": "这些数字对不上：PyTorch 保留了 {reserved}，多于总容量 {total} 减去空闲 {free}，"
        "因此无法算出 PyTorch 缓存之外的显存。",
    },
    "cause.non_pytorch.unknown": {
        "en": "Memory outside PyTorch's cache is unknown: the message does not print the free memory "
        "(total − free − reserved needs all three).",
        "zh": "PyTorch 缓存之外的显存未知：错误信息没有给出空闲显存（总量 − 空闲 − 保留需要三个数字）。",
    },
    "cause.other_processes": {
        "en": "Other processes hold {bytes} on this GPU: {processes}.",
        "zh": "其他进程在这块 GPU 上占用了 {bytes}：{processes}。",
    },
    "cause.one_process.short": {
        "en": "One process holds all the memory in use: PID {pid} has {bytes} of the {used} in use (total − free), "
        "which leaves {rest} for anything else. The message ends before PyTorch's own figures (allocated, "
        "reserved), so it does not say whose memory that is. Either PID {pid} is this process, listed under "
        "another PID because it runs in a container (PyTorch matches NVML's PID against its own), and then this "
        "run fills the card itself and needs {deficit} more than is free; or it is another process, and this one "
        "holds at most {rest}, less than a CUDA context, so it had barely started, and stopping PID {pid} frees "
        "{bytes}. A process that allocates holds a CUDA context, so the first reading is the likelier; "
        "nvidia-smi on the host, or torch.cuda.memory_reserved() in the run, tells which.",
        "zh": "一个进程占用了全部已用显存：PID {pid} 占用 {bytes}，已用显存（总量 − 空闲）为 {used}，只剩 {rest} "
        "给其他用途。错误信息在 PyTorch 自身的数字（已分配、已保留）之前就截断了，因此无法判断这是谁的显存。"
        "要么 PID {pid} 就是本进程，只是运行在容器中而以另一个 PID 列出（PyTorch 用 NVML 的 PID 与自身比较），"
        "那么是本次训练自己占满了显卡，还需要比空闲多 {deficit}；要么它是另一个进程，而本进程最多占用 {rest}，"
        "不到一个 CUDA 上下文，几乎刚刚启动，停止 PID {pid} 可以释放 {bytes}。进行分配的进程都持有 CUDA 上下文，"
        "所以第一种解释更可能；在宿主机上运行 nvidia-smi，或在训练中调用 torch.cuda.memory_reserved()，即可确认。",
    },
    "cause.one_process.fits": {
        "en": "One process holds all the memory in use: PID {pid} has {bytes} of the {used} in use (total − free), "
        "which leaves {rest} for anything else. The message ends before PyTorch's own figures (allocated, "
        "reserved), so it does not say whose memory that is. Either PID {pid} is this process, listed under "
        "another PID because it runs in a container (PyTorch matches NVML's PID against its own), or it is another "
        "process and this one holds at most {rest}, less than a CUDA context, and stopping PID {pid} frees "
        "{bytes}. A process that allocates holds a CUDA context, so the first reading is the likelier; "
        "nvidia-smi on the host, or torch.cuda.memory_reserved() in the run, tells which.",
        "zh": "一个进程占用了全部已用显存：PID {pid} 占用 {bytes}，已用显存（总量 − 空闲）为 {used}，只剩 {rest} "
        "给其他用途。错误信息在 PyTorch 自身的数字（已分配、已保留）之前就截断了，因此无法判断这是谁的显存。"
        "要么 PID {pid} 就是本进程，只是运行在容器中而以另一个 PID 列出（PyTorch 用 NVML 的 PID 与自身比较），"
        "要么它是另一个进程，而本进程最多占用 {rest}，不到一个 CUDA 上下文，停止 PID {pid} 可以释放 {bytes}。"
        "进行分配的进程都持有 CUDA 上下文，所以第一种解释更可能；在宿主机上运行 nvidia-smi，或在训练中调用 "
        "torch.cuda.memory_reserved()，即可确认。",
    },
    "cause.self_pid": {
        "en": "Process {pid} ({bytes}) is most likely this process itself: it holds PyTorch's {reserved} plus "
        "{own}, about what a CUDA context and libraries add. Inside a container NVML reports another PID, so "
        "PyTorch did not recognise it; it is not another process to stop.",
        "zh": "进程 {pid}（{bytes}）很可能就是本进程：它占用的是 PyTorch 的 {reserved} 再加 {own}，"
        "大约相当于 CUDA 上下文和库的开销。在容器中 NVML 报告的 PID 不同，PyTorch 没能识别；它不是需要停止的其他进程。",
    },
    "cause.self_pid.sure": {
        "en": "Process {pid} ({bytes}) is this process itself: its {bytes} and this process's {reserved} reserved "
        "would add up to {sum}, more than the {used} in use on the device, so they are the same memory (of it, "
        "{own} outside PyTorch's cache). Inside a container NVML reports another PID, so PyTorch did not recognise "
        "it; it is not another process to stop.",
        "zh": "进程 {pid}（{bytes}）就是本进程：它的 {bytes} 加上本进程保留的 {reserved} 合计 {sum}，"
        "超过设备上已使用的 {used}，所以它们是同一块显存（其中 {own} 在 PyTorch 缓存之外）。在容器中 NVML "
        "报告的 PID 不同，PyTorch 没能识别；它不是需要停止的其他进程。",
    },
    "cause.memory_cap": {
        "en": "PyTorch is capped at {allowed} (set_per_process_memory_fraction or "
        "PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction): {reserved} reserved + the {tried} request = {sum} "
        "is over the cap, while {free} is still free on the device.",
        "zh": "PyTorch 被限制在 {allowed}（set_per_process_memory_fraction 或 "
        "PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction）：已保留 {reserved} + 请求 {tried} = {sum}，"
        "超过了上限，而设备上仍有 {free} 空闲。",
    },
    "cause.backend_limit.xpu": {
        "en": "Single allocation above the device's limit: the {tried} request is larger than one allocation may "
        "be on Intel GPUs other than the Data Center GPU Max (max_mem_alloc_size, {limit} on Arc). Level Zero "
        "refuses it even with free memory left, and PyTorch reports that as out of memory.",
        "zh": "单次分配超过设备上限：{tried} 的请求大于英特尔 GPU（Data Center GPU Max 以外）单次分配的上限"
        "（max_mem_alloc_size，Arc 上为 {limit}）。即使还有空闲显存，Level Zero 也会拒绝，PyTorch 将其报告为显存不足。",
    },
    "cause.backend_limit.ipex": {
        "en": "Single allocation above the device's limit: intel-extension-for-pytorch refuses one block larger "
        "than 4 GB on this platform, and the {tried} request is one; this is not a lack of device memory.",
        "zh": "单次分配超过设备上限：intel-extension-for-pytorch 在此平台上拒绝大于 4 GB 的单个内存块，"
        "而 {tried} 的请求正是如此；这并不是设备显存不足。",
    },
    "cause.backend_limit.mps": {
        "en": "Single buffer above Metal's limit: the {tried} buffer is larger than the device's maxBufferLength "
        "(MPSAllocator.mm), however much memory is free.",
        "zh": "单个缓冲区超过 Metal 的上限：{tried} 的缓冲区大于设备的 maxBufferLength（MPSAllocator.mm），"
        "与空闲内存多少无关。",
    },
    "cause.shortfall": {
        "en": "True shortfall: the step needed at least {bytes} more than the GPU had ({tried} requested, "
        "{free} free). Live tensors occupy {allocated} of {total} ({share}); the step's peak is "
        "usually higher than the failed request.",
        "zh": "显存确实不够：这一步至少还需要 {bytes}（请求 {tried}，空闲 {free}）。存活张量占用了 "
        "{total} 中的 {allocated}（{share}）；这一步的峰值通常比失败的这次请求更大。",
    },
    "cause.shortfall.fragmented": {
        "en": "Free device memory alone ({free}) did not cover the {tried} request with room to spare. Undoing the "
        "fragmentation gives the step at most {unalloc} more; if it needs more than {unalloc} + {free} beyond the "
        "{allocated} allocated now, it runs out again at a later allocation.",
        "zh": "仅设备空闲显存（{free}）不足以宽裕地满足 {tried} 的请求。消除碎片最多能为这一步多提供 {unalloc}；"
        "如果它在当前已分配的 {allocated} 之外还需要超过 {unalloc} + {free}，之后的某次分配仍会失败。",
    },
    "cause.shortfall.headroom": {
        "en": "No headroom: {free} free is only {margin} more than the {tried} request, less than the {headroom} one "
        "allocation needs to spare (cudaMalloc hands out whole 2 MiB pages, and the free figure includes memory the "
        "driver keeps for itself), so the memory is used up in practice. Live tensors occupy {allocated} of {total} "
        "({share}).",
        "zh": "没有余量：空闲的 {free} 只比 {tried} 的请求多 {margin}，少于一次分配所需的 {headroom} 余量"
        "（cudaMalloc 以完整的 2 MiB 页分配，而空闲数字里包含驱动自留的显存），所以实际上显存已经用完。"
        "存活张量占用了 {total} 中的 {allocated}（{share}）。",
    },
    "cause.shortfall.exceeds_total": {
        "en": "The single {tried} request is larger than the whole GPU ({total}): no memory setting makes it fit. "
        "The tensor itself must shrink (a smaller batch or shorter sequences), or the operation must be chunked.",
        "zh": "单次请求 {tried} 比整块 GPU（{total}）还大：任何显存设置都放不下。必须缩小这个张量本身"
        "（更小的批次或更短的序列），或将该运算分块进行。",
    },
    "cause.unknown_free": {
        "en": "Whether the GPU was full cannot be told: the message does not print the free memory. PyTorch "
        "reserved {reserved} of {total} ({allocated} allocated) when the {tried} request failed; the rest was "
        "either free (then the runtime refused the allocation) or held outside PyTorch.",
        "zh": "无法判断 GPU 是否已满：错误信息没有给出空闲显存。请求 {tried} 失败时，PyTorch 在 {total} 中保留了 "
        "{reserved}（已分配 {allocated}）；其余部分要么空闲（那么是运行时拒绝了分配），要么被 PyTorch 之外占用。",
    },
    "cause.inconsistent_free": {
        "en": "The message's free figure ({free}) is larger than the device's total capacity ({total}), so it is not "
        "free memory of this device: on ROCm APUs and unified-memory systems the runtime counts system memory as "
        "free. memfit does not use it.",
        "zh": "错误信息中的空闲数字（{free}）大于设备总容量（{total}），因此它不是这块设备的空闲显存：在 ROCm APU "
        "和统一内存系统上，运行时把系统内存也算作空闲。memfit 不使用这个数字。",
    },
    "cause.free_exceeds.explained": {
        "en": "Not a lack of free memory: {free} was free, {margin} more than the {tried} request; the limit above "
        "refused the allocation.",
        "zh": "并非空闲显存不足：空闲 {free}，比 {tried} 的请求多 {margin}；是上述限制拒绝了这次分配。",
    },
    "cause.free_exceeds.others": {
        "en": "The free figure ({free}, {margin} more than the {tried} request) was read after the failure; other "
        "processes on this GPU allocate and free while they run, so at the moment of the request less was free.",
        "zh": "空闲数字（{free}，比 {tried} 的请求多 {margin}）是在分配失败之后读取的；这块 GPU 上的其他进程在运行中"
        "不断分配和释放显存，所以在请求的那一刻空闲的显存更少。",
    },
    "cause.free_exceeds.cuda": {
        "en": "Not a lack of free memory: {free} was free on the device, {margin} more than the {tried} request, yet "
        "the driver refused it, and the message shows no PyTorch memory cap. What can explain it: a per-process "
        "limit PyTorch does not print (CUDA MPS's CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, a vGPU or container limit), "
        "the Windows WDDM driver (which decides residency itself), or memory another process freed between the "
        "failure and the moment PyTorch read the free figure (it reads it after the failure).",
        "zh": "并非空闲显存不足：设备上有 {free} 空闲，比 {tried} 的请求多 {margin}，驱动却拒绝了分配，而错误信息中"
        "没有 PyTorch 的显存上限。可能的原因：PyTorch 不显示的进程级限制（CUDA MPS 的 "
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT、vGPU 或容器限制）、Windows 的 WDDM 驱动（它自行决定显存驻留），"
        "或在分配失败与 PyTorch 读取空闲数字之间有其他进程释放了显存（PyTorch 在失败之后才读取）。",
    },
    "cause.free_exceeds.windows": {
        "en": "Not a lack of free memory: {free} was free, {margin} more than the {tried} request, and the log is "
        "from Windows. There the WDDM driver, not CUDA, decides what stays in GPU memory: the free figure is its "
        "estimate and allocations can fail below it, above all when other applications (the desktop, a browser) "
        "use the GPU.",
        "zh": "并非空闲显存不足：空闲 {free}，比 {tried} 的请求多 {margin}，且日志来自 Windows。在 Windows 上由 "
        "WDDM 驱动而不是 CUDA 决定哪些内容留在显存中：空闲数字只是它的估计，分配可能在低于该值时就失败，"
        "尤其是在其他应用程序（桌面、浏览器）也使用 GPU 时。",
    },
    "cause.free_exceeds.rocm": {
        "en": "Not a lack of free memory: {free} was free, {margin} more than the {tried} request, yet hipMalloc "
        "refused it. On ROCm the HIP allocator can fail below the free figure: on APUs and MI300A it may hand out "
        "only part of the memory (96 of 128 GiB by default on MI300A), and the runtime's free figure counts memory "
        "a device allocation cannot use.",
        "zh": "并非空闲显存不足：空闲 {free}，比 {tried} 的请求多 {margin}，hipMalloc 却拒绝了分配。在 ROCm 上，"
        "HIP 分配器可能在低于空闲数字时失败：在 APU 和 MI300A 上它可能只分配部分内存（MI300A 默认 128 GiB 中只有 "
        "96 GiB），而运行时的空闲数字包含设备分配无法使用的内存。",
    },
    "cause.free_exceeds.xpu": {
        "en": "Not a lack of free memory: {free} was free, {margin} more than the {tried} request, yet Level Zero "
        "refused it: another process or the driver may hold memory the free figure does not show, or the device's "
        "single-allocation limit is lower than the request.",
        "zh": "并非空闲显存不足：空闲 {free}，比 {tried} 的请求多 {margin}，Level Zero 却拒绝了分配：可能有其他进程"
        "或驱动占用了空闲数字未反映的显存，或者设备的单次分配上限低于该请求。",
    },
    "cause.free_exceeds.xpu_estimated": {
        "en": "The free figure ({free}) is no measurement: it equals the total capacity minus PyTorch's reserved "
        "memory, the estimate PyTorch prints when the SYCL runtime cannot report free memory "
        "(XPUCachingAllocator.cpp). What other processes and the driver hold is unknown, so the {tried} request "
        "may well not have fit.",
        "zh": "空闲数字（{free}）并非实测：它等于总容量减去 PyTorch 保留的显存，这是 SYCL 运行时无法报告空闲显存时 "
        "PyTorch 打印的估计值（XPUCachingAllocator.cpp）。其他进程和驱动占用了多少未知，所以 {tried} 的请求很可能"
        "确实放不下。",
    },
    "cause.mps_watermark": {
        "en": "PyTorch's MPS memory limit: the {mps} its allocator holds + {other} of other Metal allocations in "
        "this process + the {tried} request = {sum}, over the {allowed} allowed (PYTORCH_MPS_HIGH_WATERMARK_RATIO "
        "× the device's recommended working set, 1.7 by default).",
        "zh": "PyTorch 的 MPS 内存上限：分配器持有的 {mps} + 本进程其他 Metal 分配 {other} + 请求 {tried} = {sum}，"
        "超过了允许的 {allowed}（PYTORCH_MPS_HIGH_WATERMARK_RATIO × 设备建议的工作集大小，默认 1.7）。",
    },
    "cause.mps_system.below": {
        "en": "Metal itself refused the allocation: {mps} + {other} + the {tried} request = {sum} is within the "
        "{allowed} allowed, so the system (unified memory shared with the CPU and other applications) had no "
        "memory left to give.",
        "zh": "是 Metal 自身拒绝了分配：{mps} + {other} + 请求 {tried} = {sum} 在允许的 {allowed} 之内，"
        "所以是系统（与 CPU 和其他应用共享的统一内存）已经没有可分配的内存。",
    },
    "cause.mps_system.no_limit": {
        "en": "Metal itself refused the allocation: PyTorch's MPS limit is off (PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0), "
        "and with {mps} + {other} in use the system had no memory left for the {tried} request.",
        "zh": "是 Metal 自身拒绝了分配：PyTorch 的 MPS 上限已关闭（PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0），"
        "在已使用 {mps} + {other} 的情况下，系统没有内存满足 {tried} 的请求。",
    },
    "cause.mps_other": {
        "en": "Other allocations: {other} is Metal memory of this process outside PyTorch's allocator (MPS/MPSGraph "
        "internals, buffers still held by running command buffers).",
        "zh": "其他分配：{other} 是本进程在 PyTorch 分配器之外的 Metal 内存（MPS/MPSGraph 内部、仍被运行中的命令缓冲区"
        "持有的缓冲区）。",
    },
    "cause.mps_other.large": {
        "en": "Other allocations: {other}, more than the {mps} PyTorch's allocator holds, is Metal memory of this "
        "process outside it (MPS/MPSGraph internals, buffers still held by running command buffers, other "
        "frameworks in the process); freeing it gains more than shrinking PyTorch's own memory.",
        "zh": "其他分配：{other}，比 PyTorch 分配器持有的 {mps} 还多，是本进程在分配器之外的 Metal 内存"
        "（MPS/MPSGraph 内部、仍被运行中的命令缓冲区持有的缓冲区、进程中的其他框架）；释放它比缩减 PyTorch "
        "自身的内存收益更大。",
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
    "cause.no_numbers.xpu_runtime_error": {
        "en": "The Level Zero runtime ran out of device memory outside PyTorch's caching allocator "
        "(UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY), so the message has no figures; the device was already full.",
        "zh": "Level Zero 运行时在 PyTorch 缓存分配器之外耗尽了设备显存（UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY），"
        "因此没有具体数字；设备当时已满。",
    },
    "cause.cpu": {
        "en": "Host RAM ran out, not GPU memory: a {tried} allocation on the CPU failed.",
        "zh": "耗尽的是主机内存（RAM），不是显存：CPU 上 {tried} 的分配失败了。",
    },
    # ------------------------------------------------------------------ advice
    "advice.allocator": {
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
        "en": "Check `{tool}` for other processes (a second run, a notebook kernel, DataLoader workers "
        "that touch the GPU) and stop them; do not create GPU tensors in DataLoader workers.",
        "zh": "用 `{tool}` 检查其他进程（另一个训练、Notebook 内核、使用 GPU 的 DataLoader worker）"
        "并停止它们；不要在 DataLoader worker 中创建 GPU 张量。",
    },
    "advice.check_driver.cuda": {
        "en": "Compare `nvidia-smi` with the message: look for a per-process limit (CUDA MPS's "
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, a vGPU or container limit) and for processes that come and go; the "
        "remedies below shrink the request in any case.",
        "zh": "将 `nvidia-smi` 与错误信息对比：检查是否有进程级限制（CUDA MPS 的 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT、"
        "vGPU 或容器限制）以及时有时无的进程；无论如何，下面的办法都能缩小请求。",
    },
    "advice.check_driver.windows": {
        "en": "On Windows close other applications that use the GPU (browsers, games, video), watch \"Dedicated GPU "
        "memory\" in Task Manager, and keep the run's memory well below the card's size; WSL2 or Linux gives the "
        "whole card to CUDA.",
        "zh": "在 Windows 上关闭其他使用 GPU 的应用程序（浏览器、游戏、视频），在任务管理器中查看“专用 GPU 内存”，"
        "并让训练的显存占用明显低于显卡容量；WSL2 或 Linux 可以把整块显卡交给 CUDA。",
    },
    "advice.check_driver.rocm": {
        "en": "Check `rocm-smi --showmeminfo vram` against the message; on APUs and MI300A raise the memory the GPU "
        "may allocate (the amdttm/ttm pages_limit kernel parameters) or keep the run below the allocatable part.",
        "zh": "用 `rocm-smi --showmeminfo vram` 与错误信息对比；在 APU 和 MI300A 上提高 GPU 可分配的内存"
        "（amdttm/ttm 的 pages_limit 内核参数），或让训练保持在可分配部分以内。",
    },
    "advice.check_driver.xpu": {
        "en": "Check `xpu-smi stats` for memory held outside this process; set UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1 "
        "if one tensor is larger than the device's single-allocation limit.",
        "zh": "用 `xpu-smi stats` 检查本进程之外占用的显存；如果单个张量超过设备的单次分配上限，设置 "
        "UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1。",
    },
    "advice.check_driver.xpu_estimated": {
        "en": "The runtime cannot report free memory: check `xpu-smi stats` for what is really in use.",
        "zh": "运行时无法报告空闲显存：用 `xpu-smi stats` 查看实际使用情况。",
    },
    "advice.split_allocation.xpu": {
        "en": "Make the largest single tensor smaller than the device's single-allocation limit (a smaller batch or "
        "shorter sequences shrink activations and logits), or set UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1 before "
        "Python starts to allow larger allocations (slower on some Intel GPUs).",
        "zh": "让最大的单个张量小于设备的单次分配上限（更小的批次或更短的序列会缩小激活值和 logits），或在启动 "
        "Python 之前设置 UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1 以允许更大的分配（在某些英特尔 GPU 上更慢）。",
    },
    "advice.split_allocation.ipex": {
        "en": "Keep each tensor under 4 GB (a smaller batch or shorter sequences), or move to the upstream PyTorch "
        "XPU build with UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1.",
        "zh": "让每个张量小于 4 GB（更小的批次或更短的序列），或改用上游 PyTorch 的 XPU 版本并设置 "
        "UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1。",
    },
    "advice.split_allocation.mps": {
        "en": "Make the largest single tensor smaller (a smaller batch or shorter sequences; for logits, "
        "a smaller vocabulary slice per step): no setting raises Metal's buffer limit.",
        "zh": "缩小最大的单个张量（更小的批次或更短的序列；对于 logits，每步只取更小的词表切片）："
        "没有任何设置可以提高 Metal 的缓冲区上限。",
    },
    "advice.mps_empty_cache": {
        "en": "Free what this process holds outside live tensors: call torch.mps.empty_cache() (and gc.collect()) "
        "between phases, and close other applications that use unified memory.",
        "zh": "释放本进程在存活张量之外占用的内存：在各阶段之间调用 torch.mps.empty_cache()（以及 gc.collect()），"
        "并关闭其他占用统一内存的应用程序。",
    },
    "advice.mps_watermark": {
        "en": "PYTORCH_MPS_HIGH_WATERMARK_RATIO raises the limit (0.0 removes it), but beyond the recommended working "
        "set macOS swaps and may freeze; lower the memory the run needs instead where you can.",
        "zh": "PYTORCH_MPS_HIGH_WATERMARK_RATIO 可以提高上限（0.0 表示取消），但超过建议的工作集后 macOS "
        "会使用交换内存甚至卡死；能减少训练所需内存时优先这样做。",
    },
    "advice.raise_cap": {
        "en": "Raise or remove the memory cap (torch.cuda.set_per_process_memory_fraction or "
        "per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF).",
        "zh": "提高或取消显存上限（torch.cuda.set_per_process_memory_fraction 或 "
        "PYTORCH_CUDA_ALLOC_CONF 中的 per_process_memory_fraction）。",
    },
    "advice.truncation": {
        "en": "Use shorter sequences: lower max_length / max_seq_length, and pad per batch "
        "(padding='longest', group_by_length=True) so padding does not inflate activations.",
        "zh": "缩短序列：降低 max_length / max_seq_length，并按批次填充（padding='longest'、"
        "group_by_length=True），避免填充放大激活值。",
    },
    "advice.gradient_checkpointing": {
        "en": "Turn on gradient checkpointing (TrainingArguments(gradient_checkpointing=True) or "
        "model.gradient_checkpointing_enable()): activations are recomputed in the backward pass for "
        "about 30% more compute.",
        "zh": "开启梯度检查点（TrainingArguments(gradient_checkpointing=True) 或 "
        "model.gradient_checkpointing_enable()）：反向传播时重新计算激活值，约多 30% 计算量。",
    },
    "advice.gradient_checkpointing.memfit": {
        "en": " This model's transformers 5 class has none (XLNet among them): memfit.models.blocks.enable_checkpointing "
        "provides it, and memfit train applies it.",
        "zh": "该模型在 transformers 5 中的类不支持梯度检查点（XLNet 即是如此）："
        "memfit.models.blocks.enable_checkpointing 提供了实现，memfit train 会自动使用。",
    },
    "advice.micro_batch": {
        "en": "Halve per_device_train_batch_size and double gradient_accumulation_steps: the effective batch "
        "(batch × accumulation × GPUs) and the results stay the same.",
        "zh": "将 per_device_train_batch_size 减半并将 gradient_accumulation_steps 加倍："
        "有效批次（批次 × 累积步数 × GPU 数）和训练结果保持不变。",
    },
    "advice.optimizer": {
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
    "advice.eval_settings.batch_size": {
        "en": "Lower per_device_eval_batch_size (it is set separately from the training batch size).",
        "zh": "降低 per_device_eval_batch_size（它与训练批次大小是分开设置的）。",
    },
    "advice.eval_settings.accumulation_steps": {
        "en": "Set eval_accumulation_steps (e.g. 8) so predictions move to the CPU every few steps instead "
        "of piling up on the GPU.",
        "zh": "设置 eval_accumulation_steps（例如 8），让预测结果每隔几步转移到 CPU，而不是堆积在 GPU 上。",
    },
    "advice.eval_settings.preprocess_logits": {
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
    "advice.resume_checkpoint": {
        "en": "Resuming loads the checkpoint's weights and optimizer state into a model and optimizer already on the "
        "GPU; with more than one process transformers loads optimizer.pt straight onto each GPU (trainer.py "
        "`_load_optimizer_and_scheduler`: map_location=args.device), next to the state it is copied into. Resume "
        "on GPUs with nothing else on them, or start a new run from the checkpoint's model files (a fresh "
        "optimizer state).",
        "zh": "恢复训练时，检查点的权重和优化器状态会被加载到已在 GPU 上的模型和优化器中；多进程时 transformers "
        "直接把 optimizer.pt 加载到每块 GPU 上（trainer.py `_load_optimizer_and_scheduler`：map_location=args.device），"
        "与要复制进去的状态同时存在。请在没有其他进程的 GPU 上恢复，或从检查点的模型文件开始新的训练"
        "（全新的优化器状态）。",
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
    # ------------------------------------------------------------------ advice for operations
    "advice.smaller_images": {
        "en": "The error is inside the image path: smaller images make fewer image tokens where the processor keeps "
        "the resolution (Qwen2.5-VL: cap `processor.image_processor.max_pixels`, or resize the images in the "
        "collator); `memfit plan --allow smaller_images` checks by how much.",
        "zh": "错误发生在图像路径中：在处理器保留分辨率时（如 Qwen2.5-VL），更小的图像产生更少的图像 token"
        "（限制 `processor.image_processor.max_pixels`，或在 collator 中缩放图像）；"
        "`memfit plan --allow smaller_images` 可验证能省多少。",
    },
    "advice.freeze_vision_tower": {
        "en": "Freeze the vision tower (`model.get_encoder(modality=\"image\").requires_grad_(False)`, or LoRA on "
        "the language model only): no gradients, optimizer state or weight-gradient activations for it; it changes "
        "what is trained.",
        "zh": "冻结视觉编码器（`model.get_encoder(modality=\"image\").requires_grad_(False)`，或只在语言模型上用 "
        "LoRA）：它不再有梯度、优化器状态和权重梯度所需的激活；这会改变训练的内容。",
    },
    "label.model_part": {"en": "Part of the model", "zh": "模型部分"},
    "part.vision_tower": {"en": "the vision tower (image encoder)", "zh": "视觉编码器"},
    "part.projector": {"en": "the projector between the vision tower and the language model",
                       "zh": "视觉编码器与语言模型之间的投影层"},
    "part.feature_encoder": {"en": "the convolutional feature encoder over the raw audio",
                             "zh": "原始音频上的卷积特征编码器"},
    "part.audio_encoder": {"en": "the audio encoder", "zh": "音频编码器"},
    "advice.liger": {
        "en": "Use Liger's fused linear cross-entropy, which computes the loss chunk by chunk and never "
        "materialises the full logits: `pip install liger-kernel` and TrainingArguments / SFTConfig "
        "(use_liger_kernel=True).",
        "zh": "使用 Liger 的融合线性交叉熵，它分块计算损失，从不生成完整的 logits：`pip install liger-kernel`，"
        "并设置 TrainingArguments / SFTConfig(use_liger_kernel=True)。",
    },
    "advice.logits_to_keep": {
        "en": "Where not every position needs logits (generation, GRPO completions, scoring only the last "
        "tokens), pass logits_to_keep=N to the model's forward so the LM head runs on the last N positions only.",
        "zh": "如果不是每个位置都需要 logits（生成、GRPO 补全、只对最后几个 token 打分），给模型 forward 传入 "
        "logits_to_keep=N，让 LM head 只计算最后 N 个位置。",
    },
    "advice.flash_attention": {
        "en": "Load the model with attn_implementation=\"flash_attention_2\" (`pip install flash-attn`; Ampere "
        "or newer, fp16 / bf16) or attn_implementation=\"sdpa\": neither keeps the S × S attention matrix.",
        "zh": "加载模型时使用 attn_implementation=\"flash_attention_2\"（`pip install flash-attn`；Ampere 及更新的 "
        "GPU，fp16 / bf16）或 attn_implementation=\"sdpa\"：两者都不保存 S × S 注意力矩阵。",
    },
    "advice.bnb_compute_dtype": {
        "en": "Set BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.bfloat16) (and dtype=torch.bfloat16 when "
        "loading): transformers defaults to float32, so each dequantized weight takes 4 bytes per element "
        "instead of 2.",
        "zh": "设置 BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.bfloat16)（加载时也用 dtype=torch.bfloat16）："
        "transformers 默认使用 float32，每个反量化权重每元素占 4 字节而不是 2 字节。",
    },
    "advice.kbit_prep_cast": {
        "en": "The float32 cast is for numerical stability, not required: to keep those parameters in bf16, skip "
        "prepare_model_for_kbit_training and call model.gradient_checkpointing_enable() and "
        "model.enable_input_require_grads() yourself.",
        "zh": "float32 转换是为了数值稳定，并非必需：若要让这些参数保持 bf16，跳过 prepare_model_for_kbit_training，"
        "自行调用 model.gradient_checkpointing_enable() 和 model.enable_input_require_grads()。",
    },
    "advice.precompute_ref_log_probs": {
        "en": "Set DPOConfig(precompute_ref_log_probs=True): the reference log-probabilities are computed once "
        "before training, and the reference model does not run (or stay on the GPU) during it.",
        "zh": "设置 DPOConfig(precompute_ref_log_probs=True)：参考模型的对数概率在训练前一次算好，训练期间参考模型"
        "不再运行（也不必留在 GPU 上）。",
    },
    "advice.peft_reference": {
        "en": "With a peft (LoRA) model, pass no ref_model: TRL then uses the same model with the adapter "
        "disabled as the reference, so no second copy of the weights is loaded.",
        "zh": "使用 peft（LoRA）模型时不要传入 ref_model：TRL 会用禁用适配器的同一个模型作为参考模型，"
        "不会再加载一份权重。",
    },
    "advice.generation_kv_cache": {
        "en": "Shrink the KV cache: fewer new tokens (max_new_tokens, GRPO's max_completion_length, "
        "generation_max_length with predict_with_generate), fewer sequences per generate call (num_generations, "
        "generation_batch_size, per_device_eval_batch_size, num_beams), or generate outside the training "
        "process (GRPOConfig(use_vllm=True)).",
        "zh": "缩小 KV 缓存：减少新生成的 token（max_new_tokens、GRPO 的 max_completion_length、predict_with_generate "
        "时的 generation_max_length），减少每次 generate 的序列数（num_generations、generation_batch_size、"
        "per_device_eval_batch_size、num_beams），或在训练进程之外生成（GRPOConfig(use_vllm=True)）。",
    },
    "advice.fsdp_reshard": {
        "en": "Free each unit's gathered parameters after its forward: FSDP2 fully_shard(reshard_after_forward=True) "
        "(accelerate fsdp_reshard_after_forward), FSDP1 sharding_strategy FULL_SHARD rather than SHARD_GRAD_OP, "
        "with limit_all_gathers=True and smaller wrap units.",
        "zh": "每个单元前向结束后释放收集来的参数：FSDP2 用 fully_shard(reshard_after_forward=True)（accelerate 的 "
        "fsdp_reshard_after_forward），FSDP1 用 FULL_SHARD 而不是 SHARD_GRAD_OP，并设置 limit_all_gathers=True、"
        "使用更小的包装单元。",
    },
    "advice.fsdp_cpu_offload": {
        "en": "Offload parameters to the CPU: FSDP2 offload_policy=CPUOffloadPolicy(), FSDP1 "
        "cpu_offload=CPUOffload(offload_params=True), Trainer fsdp=\"full_shard offload\" (slower).",
        "zh": "把参数卸载到 CPU：FSDP2 用 offload_policy=CPUOffloadPolicy()，FSDP1 用 "
        "cpu_offload=CPUOffload(offload_params=True)，Trainer 用 fsdp=\"full_shard offload\"（更慢）。",
    },
    "advice.more_gpus": {
        "en": "Shard over more GPUs: each GPU's share of the parameters, gradients and optimizer state shrinks "
        "with the number of GPUs.",
        "zh": "在更多 GPU 上分片：每块 GPU 分到的参数、梯度和优化器状态随 GPU 数量减少。",
    },
    "advice.zero3_live_params": {
        "en": "Lower stage3_max_live_parameters (default 1e9) and stage3_prefetch_bucket_size (default 5e7) in "
        "the DeepSpeed config's zero_optimization, and stage3_max_reuse_distance with them: fewer gathered "
        "parameters stay on the GPU.",
        "zh": "在 DeepSpeed 配置的 zero_optimization 中降低 stage3_max_live_parameters（默认 1e9）和 "
        "stage3_prefetch_bucket_size（默认 5e7），同时降低 stage3_max_reuse_distance：留在 GPU 上的已收集参数更少。",
    },
    "advice.zero_offload_param": {
        "en": "Offload parameters with ZeRO-3: \"offload_param\": {{\"device\": \"cpu\"}} in zero_optimization "
        "(slower; optimizer state with \"offload_optimizer\").",
        "zh": "用 ZeRO-3 卸载参数：在 zero_optimization 中设置 \"offload_param\": {{\"device\": \"cpu\"}}"
        "（更慢；优化器状态用 \"offload_optimizer\"）。",
    },
    "advice.zero_bucket_sizes": {
        "en": "Lower reduce_bucket_size and allgather_bucket_size (default 5e8 elements each) in zero_optimization, "
        "e.g. to 5e7: the buckets are that many elements of the gradient dtype.",
        "zh": "在 zero_optimization 中降低 reduce_bucket_size 和 allgather_bucket_size（默认各 5e8 个元素），"
        "例如降到 5e7：每个桶就是这么多个梯度精度的元素。",
    },
    "advice.collective_output": {
        "en": "Gather less at once: all_gather's output is world size × its input. If FSDP or ZeRO-3 issues it, "
        "see their settings (reshard_after_forward, stage3_prefetch_bucket_size); in your own code gather in "
        "chunks or to the CPU.",
        "zh": "一次少收集一些：all_gather 的输出是输入的 world size 倍。若由 FSDP 或 ZeRO-3 发起，调整它们的设置"
        "（reshard_after_forward、stage3_prefetch_bucket_size）；若在自己的代码里，分块收集或收集到 CPU。",
    },
    "advice.nccl_buffers": {
        "en": "Leave room for NCCL outside PyTorch's cache: every communicator (process group) allocates its own "
        "buffers (about 1 GiB each, as reported in pytorch/pytorch#153302), so create fewer process groups, "
        "lower NCCL_BUFFSIZE (default 4 MiB, NCCL docs), and keep the training's own peak below the card's size.",
        "zh": "在 PyTorch 缓存之外为 NCCL 留出空间：每个通信器（进程组）都会分配自己的缓冲区（pytorch/pytorch#153302 "
        "中报告每个约 1 GiB），所以减少进程组数量、降低 NCCL_BUFFSIZE（NCCL 文档：默认 4 MiB），并让训练本身的峰值低于显卡容量。",
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

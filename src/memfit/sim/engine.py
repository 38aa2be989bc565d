"""Run the training step Trainer runs, on fake (or real CPU) tensors, and record the trace.

The sequence mirrors transformers 5 `Trainer._inner_training_loop` / `training_step` /
`evaluation_loop` with accelerate's wrappers, as a CUDA run executes it:

    weights to the device                         (setup)
    2 optimizer steps, each of `gradient_accumulation_steps` micro-steps:
        batch to the device; forward under autocast; outputs -> fp32   (forward)
        loss / accumulation; GradScaler.scale; backward                 (backward)
    after the last micro-step: unscale_, clip_grad_norm_ (foreach), optimizer.step(),
        scaler.update, model.zero_grad(set_to_none=True)               (optimizer)
    evaluation: no_grad forward under autocast, predictions, labels and losses kept on
        the device until `eval_accumulation_steps`                      (eval)

Micro-steps after the second of an optimizer step repeat the second exactly (same live
gradients, same temporaries), so at most two are simulated per optimizer step.

Known limitations: the caching allocator is not modelled here (see memfit.allocator.caching);
collectives, DeepSpeed and FSDP are not simulated; cuBLAS workspaces are not tensors and
are counted outside this trace.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.sim.quiet import isolated_simulation
from memfit.models.build import ModelSpec, to_empty_tied
from memfit.models.processors import MediaInputs, media_inputs
from memfit.models.resolve import resolve
from memfit.models.quantization import capture, parameter_count, quant_state_tensors, quiet_bnb_logs, restore
from memfit.sim import _torch_adapter as adapter
from memfit.sim.autocast import cuda_autocast, cuda_autocast_policy
from memfit.sim.cuda_patches import cuda_patches
from memfit.sim.optimizers import build_optimizer
from memfit.sim.prepare import prepare_model
from memfit.sim.splice import LayerTagger, SpliceRefused, cut_block, splice_events
from memfit.sim.tracker import StorageTracker, TrackedEvent
from memfit.sim import trl_steps
from memfit import progress
from memfit.trace import TraceEvent
from memfit.train_setup import TrainSetup

if TYPE_CHECKING:
    from memfit.gpus.catalog import GpuSpec

__all__ = ["Simulation", "simulate"]

_LOW = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
#: GradScaler(init_scale=2.**16) as accelerate builds it (torch/amp/grad_scaler.py).
_INIT_SCALE = 2.0**16
#: Eval examples assumed when the setup does not say (sizes the on-device prediction buffer).
DEFAULT_EVAL_SAMPLES = 1000
#: At most this many prediction-concatenation steps are written to the trace (the last ones).
_MAX_EVAL_CONCAT_EVENTS = 64
#: vision-window notes already said on stderr in this process (a plan's simulations repeat them)
_SAID: set[str] = set()


@dataclass
class Simulation:
    """What one simulated run produced."""

    trace: list[TraceEvent]
    params: int
    trainable_params: int
    checkpointing: str | None  # "huggingface", "memfit" or None
    sdpa_backends: list[str]
    notes: list[str] = field(default_factory=list)
    attn_kernels: list[str] = field(default_factory=list)
    attn_implementation: str | None = None
    """Emulated attention kernels that ran (flash_attention_2, flash_attention_2:varlen, ...)."""
    model_name: str = ""
    model_type: str = ""
    eval_steps_held: int = 0
    weights_dtype: str = "float32"
    quantization: dict | None = None  #: memfit.models.quantization.quantization_summary
    paged_bytes: int = 0  #: optimizer state in CUDA managed memory (paged optimizers), not in the trace
    media_inputs: dict | None = None  #: what the processor made of each image or clip (MediaInputs.summary)


def _media_batch(setup: TrainSetup, batch: int, media: MediaInputs, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an image or speech collator hands the model: the processor's outputs (memfit.models.processors)
    stacked `batch` times, and the labels. Image classification: one class id per image (DefaultDataCollator);
    speech-seq2seq: the padded token ids of the transcript, `target_length` (else `max_length`) long (the Whisper
    fine-tuning guide's DataCollatorSpeechSeq2SeqWithPadding, labels only: the model shifts them into
    decoder_input_ids); ctc: the transcript's characters. An `attention_mask` the extractor returns is all ones."""
    out = {name: (torch.ones if name == "attention_mask" else torch.zeros)(batch, *shape, dtype=dtype)
           for name, (shape, dtype) in media.tensors.items()}  # every clip of the batch its full length
    if setup.task == "image-cls":
        out["labels"] = torch.zeros(batch, dtype=torch.float32 if setup.num_labels == 1 else torch.long)
    elif setup.task == "ctc":
        # DataCollatorCTCWithPadding (the CTC fine-tuning blog, run_speech_recognition_ctc.py): the characters of
        # each transcript, padded with -100; memfit's batch: every transcript the longest (`label_length`,
        # memfit.models.processors), all of them targets (not the blank, `pad_token_id`)
        config = model.config
        out["labels"] = torch.full((batch, media.summary["label_length"]),
                                   (config.pad_token_id + 1) % config.vocab_size, dtype=torch.long)
    else:
        out["labels"] = torch.zeros(batch, setup.target_length or setup.max_length, dtype=torch.long)
    return out


def _check_media_dtypes(model: nn.Module, media: MediaInputs, setup: TrainSetup,
                        compute_capability: tuple[int, int]) -> None:
    """A one-line MemfitError for a run that fails on its first convolution: without autocast (fp32 precision) the
    processor's float32 pixel_values / input_features meet 16-bit weights, and F.conv1d / conv2d raise "Input type
    (float) and bias type (c10::Half) should be the same", on a GPU as on the CPU. The message names the flags of
    the change that runs (memfit.sim.media_dtypes)."""
    from memfit.sim.media_dtypes import dtype_fix

    weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    fix = dtype_fix(weights, media, setup.precision, compute_capability)
    if fix is not None:
        raise MemfitError(f"{fix.cause}; use `{fix.flags}` ({fix.why_changes}), or `--weights-dtype fp32` alone to "
                          "train in fp32")


def _make_batch(model: nn.Module, setup: TrainSetup, batch: int, *, seq: int,
                media: MediaInputs | None = None) -> dict[str, torch.Tensor]:
    """The tensors DataCollatorWithPadding hands the model (int64, padded to `seq`); image and speech models get
    `_media_batch`'s."""
    if media is not None and media.example is not None:  # a vision-language model: real host data
        from memfit.sim.host_values import image_text_batch

        return image_text_batch(media.example, batch)
    if media is not None:
        return _media_batch(setup, batch, media, model)
    config = getattr(model, "config", None)
    params = inspect.signature(model.forward).parameters
    out = {"input_ids": torch.zeros(batch, seq, dtype=torch.long)}
    if "attention_mask" in params:
        out["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
        # A padded batch: the last example is one token shorter than the longest. transformers
        # skips the attention mask when it is all ones (masking_utils `_ignore_causal_mask_sdpa`,
        # `_ignore_bidirectional_mask_sdpa`), but cannot read a FakeTensor and then always builds
        # it; with one pad token a real run takes the same branch (tests/sim/test_exactness.py).
        # In place on a view: no allocation.
        out["attention_mask"][-1, -1:].zero_()
    model_type = getattr(config, "model_type", "")
    if "token_type_ids" in params and (getattr(config, "type_vocab_size", 0) > 1 or model_type == "xlnet"):
        out["token_type_ids"] = torch.zeros(batch, seq, dtype=torch.long)
    task = setup.task
    if task == "seq-cls":
        if setup.num_labels == 1:
            out["labels"] = torch.zeros(batch, dtype=torch.float32)
        else:
            out["labels"] = torch.zeros(batch, dtype=torch.long)
    elif task in ("token-cls", "mlm", "causal-lm"):
        out["labels"] = torch.zeros(batch, seq, dtype=torch.long)
    elif task == "qa":
        out["start_positions"] = torch.zeros(batch, dtype=torch.long)
        out["end_positions"] = torch.zeros(batch, dtype=torch.long)
    elif task == "seq2seq-lm":
        out["labels"] = torch.zeros(batch, setup.target_length or seq, dtype=torch.long)
    return out


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """Trainer.__init__ `model_accepts_loss_kwargs` (transformers 5.24): the unwrapped model's
    `accepts_loss_kwargs`, else whether its forward takes **kwargs."""
    unwrapped = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(unwrapped, "accepts_loss_kwargs"):
        return bool(unwrapped.accepts_loss_kwargs)
    params = inspect.signature(unwrapped.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


class _Runner:
    def __init__(self, setup: TrainSetup, *, fake: bool, splice: bool, spec: ModelSpec | None = None,
                 gpu: GpuSpec | None = None) -> None:
        self.setup = setup
        self.fake = fake
        self.low = _LOW[setup.precision]
        # the target GPU: its GpuSpec (memfit.gpus.catalog), else only the compute capability the setup names
        self.gpu = gpu
        self.compute_capability = tuple(gpu.compute_capability if gpu is not None else setup.compute_capability)
        prepared = prepare_model(setup, splice=splice, compute_capability=self.compute_capability,
                                 amp_dtype=self.low, spec=spec)
        self.spec = prepared.spec
        self.notes = prepared.notes
        self.flash_log, self.flex_log = prepared.flash_log, prepared.flex_log
        self.quant, self.quant_summary = prepared.quant, prepared.quant_summary
        self.ref_model = prepared.ref_model
        self.ref_cut = prepared.ref_cut
        self.reward_model = prepared.reward_model
        self.model = prepared.model
        self.cut, self.sizes, self.names = prepared.cut, prepared.sizes, prepared.names
        self.checkpointing = prepared.checkpointing
        self.fwd_model = self.cut if self.cut is not None else self.model
        # image / audio inputs: the model's own processor runs here, on real arrays, before any fake mode
        if setup.task == "image-text-to-text" and getattr(setup, "video_frames", None) is not None:  # a clip
            from memfit.models.video_inputs import video_text_inputs

            self.media = video_text_inputs(setup, self.spec)
        elif setup.task == "image-text-to-text":  # images and text: real host data (memfit.sim.host_values)
            from memfit.models.image_text import image_text_inputs

            self.media = image_text_inputs(setup, self.spec)
        else:
            self.media = media_inputs(setup, self.spec, self.model)
        if self.media is not None:
            self.notes = [*self.notes, *self.media.notes]
            _check_media_dtypes(self.model, self.media, setup, self.compute_capability)
            self._note_vision_windows(setup)
        self.eval_model = self.fwd_model  # the evaluation forward is spliced too
        self.host = None  # memfit.sim.host_values.HostValues of a vision-language model (`_cuda_emulation`)
        self.liger_log: list[str] = []
        self._act_offload = None
        self.sdpa_backends: list[str] = []
        self.tracker = StorageTracker()
        if self.cut is not None:
            self.tagger = LayerTagger(self.cut, self.tracker, self.names)
            self.tracker.tag_fn = self.tagger.current

    # -- phases ----------------------------------------------------------------------------
    def _materialize(self) -> None:
        """model.to("cuda"): each parameter and buffer becomes a device allocation."""
        tr = self.tracker
        tr.phase = "setup"
        tr.paused = True
        quantized = {}
        if self.quant is not None:  # to_empty drops the bitsandbytes parameters' quant states
            quantized = {id(m): capture(m) for m in (self.model, self.cut) if m is not None}
        to_empty_tied(self.model, device="cpu")  # plain to_empty unties shared weights
        if self.cut is not None:
            to_empty_tied(self.cut, device="cpu")
        if self.setup.lora_r is not None or self.setup.peft_config:  # peft: meta tensors in plain attributes
            from memfit.models.peft_methods import materialize_plain_tensors

            for m in (self.model, self.cut):
                if m is not None:
                    materialize_plain_tensors(m, device="cpu")
        for m in (self.model, self.cut):
            if m is not None and id(m) in quantized:
                restore(m, quantized[id(m)], "cpu")
        if not self.fake:
            # to_empty leaves garbage in real storages; a garbage `position_ids` buffer indexes out
            # of range. Zeros keep every real run well defined (values never change the trace).
            with torch.no_grad():
                for module in (self.model, self.cut):
                    if module is not None:
                        for tensor in list(module.parameters()) + list(module.buffers()):
                            tensor.zero_()
        tr.paused = False
        q_model = quant_state_tensors(self.model) if self.quant is not None else []
        for name, tensor in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            tr.module = name  # what the storage is (memfit.report's hover)
            tr.register(tensor, "weights")
        tr.module = ""
        for tensor in q_model:
            tr.register(tensor, "weights")
        if self.cut is not None:
            q_cut = quant_state_tensors(self.cut) if self.quant is not None else []
            for tensor in list(self.cut.parameters()) + list(self.cut.buffers()) + q_cut:
                tr.ignore(tensor)
            self.tagger.index_params()
        if self.setup.precision == "fp16":
            # GradScaler._lazy_init_scale_growth_tracker: a float scale and an int32 tracker on the device.
            self.scale = torch.full((), _INIT_SCALE, dtype=torch.float32)
            self.growth = torch.full((), 0, dtype=torch.int32)
        # Trainer keeps the running loss on the device: `tr_loss = torch.tensor(0.0, device=...)`.
        self.tr_loss = torch.tensor(0.0)
        self.grad_recs = None

    def _register_batch(self, batch: dict[str, torch.Tensor]) -> None:
        for t in batch.values():
            self.tracker.register(t, "inputs")

    def _forward(self, batch, *, training: bool):
        amp = cuda_autocast(self.low)
        with amp:
            out = (self.fwd_model if training else self.eval_model)(**batch)
        if self.low is not None:
            from accelerate.utils import convert_to_fp32  # accelerate's ConvertOutputsToFp32

            out = convert_to_fp32(out)
        return out

    def micro_step(self, accumulation: int) -> None:
        tr = self.tracker
        self.fwd_model.train()
        tr.phase = "forward"
        tr.module = ""
        first_event = len(tr.events)
        if self.cut is not None:
            self.tagger.reset()
            # block i - 1's output, when no op of block i saved it for the backward (half-precision weights: the
            # norm saves its fp32 upcast), is freed between blocks i and i + 1, as in the evaluation's forward
            self.tagger.gaps = True
        if self.host is not None:  # a vision-language model's host data (memfit.sim.host_values)
            self.host.active = True
        scaled_for_ga = False
        if self.setup.trainer != "trainer":  # TRL: SFT / DPO batch and loss
            loss, start = trl_steps.micro_loss(self)
            scaled_for_ga = self.setup.trainer in trl_steps.LOSS_SCALED_FOR_GA  # TRL's loss_is_scaled_for_ga
            # GRPO splices its generation and scoring passes as they run; what is left starts after them
            first_event = max(first_event, getattr(self, "grpo_spliced_events", first_event))
        else:
            seq = self.setup.sequence_length
            batch = _make_batch(self.fwd_model, self.setup, self.setup.per_device_train_batch_size, seq=seq,
                                media=self.media)
            self._register_batch(batch)
            # Trainer (transformers 5.24 get_batch_samples / compute_loss): a model whose forward takes loss kwargs gets
            # `num_items_in_batch` (the window's label count, an int64 scalar moved to the device); ForCausalLMLoss then
            # sums and divides (fixed_cross_entropy) and training_step does not divide by the accumulation
            if self.setup.task in ("causal-lm", "image-text-to-text") and "labels" in batch \
                    and _accepts_loss_kwargs(self.fwd_model):
                batch["num_items_in_batch"] = torch.zeros((), dtype=torch.long)
                self.tracker.register(batch["num_items_in_batch"], "inputs")
                scaled_for_ga = True
            start = len(tr.records)
            if self.setup.activation_offloading:  # TRL SFTTrainer wraps the forward (compute_loss) in it
                from memfit.sim.offload import trl_activation_offloading

                if self._act_offload is None:
                    self._act_offload = trl_activation_offloading(self.fwd_model, tr)
                with self._act_offload():
                    out = self._forward(batch, training=True)
            else:
                out = self._forward(batch, training=True)
            loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
            del out, batch
        if accumulation > 1 and not scaled_for_ga:
            loss = loss / accumulation  # Trainer.training_step when the loss is not GA-normalised
        for rec in tr.records[start:]:
            if rec.alive and rec.category == "temporaries":
                rec.category = "activations"
        if self.cut is not None:
            self.tagger.gaps, self.tagger.trailing = False, None
        tr.phase = "backward"
        if self.setup.precision == "fp16":
            loss = loss * self.scale  # GradScaler.scale
        loss.backward()
        if self.host is not None:
            self.host.active = False
        for p in self.fwd_model.parameters():
            if p.grad is not None:
                rec = tr.record_of(p.grad)
                if rec is not None:
                    rec.category = "gradients"
        tr.paused = True  # Trainer's running loss: one device scalar, updated in place in effect
        self.tr_loss = self.tr_loss + loss.detach()
        tr.paused = False
        del loss
        if self.cut is not None:
            self._splice(first_event)
        if self.grad_recs is None:
            self.grad_recs = {
                name: tr.record_of(p.grad) for name, p in self.model.named_parameters() if p.grad is not None
            }

    def replay(self, first: int, last: int) -> None:
        """Append a copy of events[first:last] with fresh storages (a micro-step that repeats one
        already simulated), and give the model the gradients that copy allocates."""
        tr = self.tracker
        mapping: dict[int, object] = {}
        for action, rec, phase, tag in tr.events[first:last]:
            if action == "alloc":
                new = tr.new_record_like(rec, rec.module)
                mapping[rec.id] = new
                tr.events.append(TrackedEvent("alloc", new, phase, tag))
            else:
                new = mapping.get(rec.id)
                if new is not None and new.alive:
                    new.alive = False
                    tr.events.append(TrackedEvent("free", new, phase, tag))
        for name, p in self.model.named_parameters():
            rec = self.grad_recs.get(name) if self.grad_recs else None
            if rec is None or p.grad is not None:
                continue
            new = mapping.get(rec.id)
            if new is not None:
                self._bind_grad(p, new)

    def _bind_grad(self, p: torch.Tensor, rec) -> None:
        """Give `p` a gradient whose storage is the one `rec` already describes (no new event)."""
        self.tracker.paused = True
        p.grad = torch.empty_like(p)
        self.tracker.paused = False
        self.tracker.bind(p.grad, rec)

    def _note_vision_windows(self, setup: TrainSetup) -> None:
        """A windowed vision tower beyond what memfit has measured: say now, on stderr, what simulating it takes
        (memfit.sim.vision_windows), and keep the note with the result."""
        import sys

        from memfit.sim.vision_windows import vision_window_cost

        config = getattr(self.model, "config", None)
        if self.media.example is None or config is None:
            return
        attn = getattr(getattr(config, "vision_config", None), "_attn_implementation", None) \
            or getattr(config, "_attn_implementation", None)
        cost = vision_window_cost(config, self.media.example, setup.per_device_train_batch_size, attn)
        note = None if cost is None else cost.note()
        if note is not None and note not in self.notes:
            self.notes = [*self.notes, note]
            if note not in _SAID:
                _SAID.add(note)
                print(f"memfit: note: {note}", file=sys.stderr, flush=True)

    def _splice(self, first_event: int) -> None:
        """Write the full model's events for what the cut model just ran; bind the full model's grads."""
        tr = self.tracker
        copies = splice_events(tr, first_event, self.sizes, self.names)
        cut_params = dict(self.cut.named_parameters())
        for name, p in self.model.named_parameters():
            if p.grad is not None or not p.requires_grad:
                continue
            cut_name, n = self._cut_name(name)
            cp = cut_params.get(cut_name)
            if cp is None or cp.grad is None:
                continue
            rec = tr.record_of(cp.grad)
            if rec is None or rec.id < 0:
                continue
            if n is not None:
                rec = copies.get(rec.id, {}).get(n)
                if rec is None:
                    continue
            self._bind_grad(p, rec)
        for cp in self.cut.parameters():
            if cp.grad is not None:
                tr.forget(cp.grad)

    def _cut_name(self, name: str) -> tuple[str, int | None]:
        """Full-model parameter name -> (cut-model name, copy index if it is a generic block)."""
        for j, list_name in self.names.items():
            prefix = list_name + "."
            if name.startswith(prefix):
                idx, _, rest = name[len(prefix):].partition(".")
                i, copy_n = cut_block(int(idx), self.sizes[j])
                return f"{prefix}{i}.{rest}", copy_n
        return name, None

    def optimizer_step(self) -> None:
        tr = self.tracker
        tr.phase = "optimizer"
        start = len(tr.records)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        if self.setup.precision == "fp16":
            # GradScaler.unscale_ -> _unscale_grads_ (torch/amp/grad_scaler.py)
            inv_scale = self.scale.double().reciprocal().float()
            found_inf = torch.full((), 0.0, dtype=torch.float32)
            adapter.amp_unscale_(grads, found_inf, inv_scale)
        if self.setup.max_grad_norm > 0 and grads:
            # torch.nn.utils.clip_grad_norm_ with foreach (the CUDA default): _get_total_norm and
            # _clip_grads_with_norm_ in torch/nn/utils/clip_grad.py.
            norms = adapter.foreach_norm(grads, 2.0)
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(n, 2.0) for n in norms]), 2.0)
            del norms
            coef = torch.clamp(self.setup.max_grad_norm / (total + 1e-6), max=1.0)
            adapter.foreach_mul_(grads, coef)
            del coef
            self.grad_norm = total
        del grads
        self.optimizer.step()
        if self.setup.precision == "fp16":
            adapter.amp_update_scale_(self.scale, self.growth, found_inf, 2.0, 0.5, 2000)
            del found_inf, inv_scale
        self.model.zero_grad(set_to_none=True)
        if self.cut is not None:
            self.cut.zero_grad(set_to_none=True)
        for rec in tr.records[start:]:
            if rec.alive and rec.category == "temporaries":
                # ZeRO-Offload keeps the optimizer state in host memory (memfit.remedies.offload)
                rec.category = "host" if self.setup.offload_optimizer_state else "optimizer_state"
        # Non-fused torch optimizers keep `step` on the host (torch/optim/adam.py `_init_group`).
        fused = bool(self.optimizer.defaults.get("fused"))
        for state in self.optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor) and not fused:
                rec = tr.record_of(step)
                if rec is not None:
                    rec.category = "host"
        for buf in getattr(self.optimizer, "paged_tensors", ()):  # paged optimizers: cudaMallocManaged
            rec = tr.record_of(buf)
            if rec is not None:
                rec.category = "paged"

    def evaluate(self) -> int:
        tr = self.tracker
        s = self.setup
        tr.phase = "eval"
        # the evaluation forward is spliced as the training one is: the cut model runs and
        # memfit.sim.splice writes the full model's events (tests/sim/test_splice.py checks equal figures)
        self.eval_model.eval()
        first_event = len(tr.events)
        if self.cut is not None:
            self.tagger.reset()
            self.tagger.gaps = True
            tr.tag_fn = self.tagger.current
        else:
            tr.tag_fn = lambda: None
        if s.trainer in trl_steps.GENERATING_EVAL:  # its prediction_step generates and scores first
            return self._generating_evaluate(first_event)
        batch = _make_batch(self.eval_model, s, s.per_device_eval_batch_size, seq=s.sequence_length, media=self.media)
        self._register_batch(batch)
        if self.host is not None:
            self.host.active = True
        ignore = set(getattr(getattr(self.model, "config", None), "keys_to_ignore_at_inference", []) or [])
        # Seq2SeqTrainer.prediction_step with predict_with_generate: `generate` first, then the forward for the loss
        # with the generated tokens kept (memfit.sim.seq2seq_generation, in closed form)
        gen = self._generation(batch) if s.predict_with_generate else None
        generated = None
        if gen is not None:
            held_gen = [tr.synthetic_alloc(gen.encoder_output_bytes, "temporaries"),
                        tr.synthetic_alloc(gen.cross_attention_cache_bytes, "temporaries"),
                        tr.synthetic_alloc(gen.self_attention_cache_bytes, "temporaries"),
                        tr.synthetic_alloc(gen.generated_tokens_bytes, "temporaries"),
                        tr.synthetic_alloc(gen.step_logits_bytes, "temporaries")]
            for rec in held_gen[:3] + held_gen[4:]:
                tr.synthetic_free(rec)
            generated = held_gen[3]  # `generate` returns one sequence per input: [batch, max_length] int64
        with torch.no_grad():
            out = self._forward(batch, training=False)
            items = dict(out.items()) if hasattr(out, "items") else {"logits": out}
            loss = items.pop("loss", None)
            preds = [v for k, v in items.items() if k not in ignore and isinstance(v, torch.Tensor)]
            if gen is not None:  # prediction_step keeps only the loss of this forward
                preds = []
            labels = [batch[k] for k in ("labels", "start_positions", "end_positions") if k in batch]
            del out, items
            if self.host is not None:
                self.host.active = False
            # EvalLoopContainer.add / nested_concat (transformers/trainer_pt_utils.py): each step
            # concatenates the new batch to the buffer kept on the device -> a new buffer of k
            # batches while the old one of k-1 batches is still alive.
            per_step = []
            if loss is not None:
                losses = loss.detach().mean().repeat(s.per_device_eval_batch_size)
                per_step.append(losses.untyped_storage().nbytes())
            if not s.prediction_loss_only and gen is not None:
                # the generated tokens and the labels, each padded to max_length (`_pad_tensors_to_max_len`)
                n = s.per_device_eval_batch_size
                per_step.append(n * gen.max_length * 8)
                per_step += [max(t.untyped_storage().nbytes(), n * gen.max_length * t.element_size()) for t in labels]
            elif not s.prediction_loss_only:
                per_step += [t.untyped_storage().nbytes() for t in preds]
                per_step += [t.untyped_storage().nbytes() for t in labels]
        if generated is not None:
            tr.synthetic_free(generated)
        alive = [preds, labels, loss, batch]  # the loop's variables live on while the buffers grow
        del preds, labels, loss, batch
        return self._hold_eval_outputs(per_step, s.eval_samples or DEFAULT_EVAL_SAMPLES, first_event, alive)

    def _generating_evaluate(self, first_event: int) -> int:
        """GRPO / RLOO / distillation: `prediction_step` generates, scores and computes the loss of the eval batch
        under no_grad (memfit.sim.trl_steps.eval_loss, which splices its own passes); the loop keeps the losses
        (`losses.repeat(batch_size)`, no logits or labels). GRPO's and RLOO's eval sampler repeats each example
        `num_generations_eval` times."""
        s = self.setup
        loss = trl_steps.eval_loss(self)
        first_event = max(first_event, getattr(self, "grpo_spliced_events", first_event))
        losses = loss.repeat(s.per_device_eval_batch_size)
        per_step = [losses.untyped_storage().nbytes()]
        alive = [loss, losses]
        del loss, losses
        samples = s.eval_samples or DEFAULT_EVAL_SAMPLES
        if s.trainer in ("grpo", "rloo"):
            samples *= s.num_generations_eval or s.num_generations
        return self._hold_eval_outputs(per_step, samples, first_event, alive)

    def _hold_eval_outputs(self, per_step: list[int], samples: int, first_event: int, alive: list) -> int:
        """EvalLoopContainer's device buffers over the eval steps (`per_step` bytes each step) while the last step's
        tensors (`alive`, emptied here) are alive, then the splice of the evaluation and train mode back; the number
        of eval steps the buffers hold."""
        tr = self.tracker
        s = self.setup
        n_steps = math.ceil(samples / s.per_device_eval_batch_size)
        held = min(n_steps, s.eval_accumulation_steps or n_steps)
        first = max(1, held - _MAX_EVAL_CONCAT_EVENTS + 1)
        buffers = []
        for size in per_step:
            buffers.append(tr.synthetic_alloc(size * (first - 1), "eval_outputs") if first > 1 else None)
        for k in range(first, held + 1):
            for i, size in enumerate(per_step):
                new = tr.synthetic_alloc(size * k, "eval_outputs")
                if buffers[i] is not None:
                    tr.synthetic_free(buffers[i])
                buffers[i] = new
        alive.clear()
        for b in buffers:
            if b is not None:
                tr.synthetic_free(b)
        if self.cut is not None:
            self.tagger.gaps = False
            tr.tag_fn = lambda: None
            splice_events(tr, first_event, self.sizes, self.names)  # SpliceRefused: simulate() runs the full model
        self.eval_model.train()
        return held

    def _generation(self, batch: dict[str, torch.Tensor]):
        """The sizes of Seq2SeqTrainer's `generate` on this eval batch (memfit.sim.seq2seq_generation)."""
        from memfit.sim.seq2seq_generation import generation_max_length, seq2seq_generation
        from memfit.units import format_bytes

        s, config = self.setup, self.model.config
        if self.media is not None and self.media.summary.get("encoder_positions"):
            positions = self.media.summary["encoder_positions"]
        else:
            positions = batch["input_ids"].shape[-1] if "input_ids" in batch else s.sequence_length
        weights = next(iter(self.model.parameters())).element_size()
        gen = seq2seq_generation(config, batch=s.per_device_eval_batch_size, beams=s.generation_num_beams or 1,
                                 max_length=generation_max_length(config, s.generation_max_length),
                                 encoder_positions=positions,
                                 cache_dtype_bytes=2 if self.low is not None else weights,
                                 encoder_output_dtype_bytes=4 if self.low is not None else weights)
        note = (f"predict_with_generate: the evaluation's `generate` holds a KV cache of "
                f"{format_bytes(gen.kv_cache_bytes)} ({format_bytes(gen.self_attention_cache_bytes)} self-attention "
                f"over {gen.max_length - 1} tokens, {format_bytes(gen.cross_attention_cache_bytes)} cross-attention over "
                f"{positions} encoder positions; {gen.sequences} sequences), sized in closed form from the config "
                "(memfit.sim.seq2seq_generation), not traced")
        if note not in self.notes:
            self.notes.append(note)
        return gen

    # -- the run ---------------------------------------------------------------------------
    def _fake_gradients(self) -> None:
        """Gradients as a finished backward leaves them (optimizer-only runs)."""
        self.tracker.phase = "backward"
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.empty_like(p)
                self.tracker.register(p.grad, "gradients")

    def _cuda_emulation(self) -> tuple[list[contextlib.AbstractContextManager], Any]:
        """What makes the CPU run allocate as the CUDA run does, in the order `run` enters it, and
        bitsandbytes' emulated kernels (None unless the weights are quantized: their GEMM paths go to
        the report). Only builds them: each is imported here, before the fake mode and the tracker run."""
        s = self.setup
        cc = self.compute_capability
        contexts: list[contextlib.AbstractContextManager] = []
        if self.flex_log is not None:  # flex attention's compiled kernels emulated
            from memfit.sim.kernels.flex_attn import flex_patches

            contexts.append(flex_patches(self.flex_log))
        if s.float8_recipe is not None:  # torchao Float8: Float8Linear asks for CUDA's autocast state
            from memfit.models.float8 import cuda_autocast_queries

            contexts.append(cuda_autocast_queries())
        if s.use_liger_kernel:  # Trainer's apply_liger_kernel, Triton emulated
            from memfit.sim.kernels.liger import liger_emulation
            from memfit.sim.kernels.sdpa_choice import num_sms

            contexts.append(liger_emulation([m for m in (self.model, self.cut) if m is not None],
                                            trl_steps.liger_config(s), num_sms=num_sms(self.gpu),
                                            compute_capability=cc, log=self.liger_log))
        if self.fake:
            from memfit.sim.layouts import CudaLayouts

            contexts.append(adapter.new_fake_mode())
            contexts.append(CudaLayouts())  # outputs laid out as CUDA's kernels lay them out (sim.layouts)
        contexts.append(self.tracker)
        contexts.append(cuda_patches(compute_capability=cc, sdpa_log=self.sdpa_backends, flash_log=self.flash_log,
                                     sm_count=getattr(self.gpu, "sm_count", None)))
        if s.task == "ctc":  # CTC speech models: their host-side reads and CUDA's ctc_loss (sim._ctc_adapter)
            from memfit.sim._ctc_adapter import ctc_patches

            contexts.append(ctc_patches([m for m in (self.model, self.cut) if m is not None]))
        if self.media is not None and self.media.example is not None:  # host data stays real (sim.host_values)
            from memfit.sim.host_values import HostValues

            self.host = HostValues(self.tracker, fake=self.fake)
            contexts.append(self.host)
        if (s.gradient_checkpointing_kwargs or {}).get("offload") and self.checkpointing == "huggingface":
            from memfit.sim.offload import host_offload_patch  # checkpointed inputs kept in host memory

            contexts.append(host_offload_patch(self.tracker))
        contexts.append(cuda_autocast_policy(self.low))
        if s.peft_config or s.use_dora:  # peft methods: host-side values peft reads (models._peft_adapter)
            from memfit.models._peft_adapter import run_patches

            contexts.append(run_patches(quantized=self.quant is not None))
        contexts.append(trl_steps.kernels(s))  # TRL: its Triton kernels' CPU fallbacks stood in for
        kernels = None
        if self.quant is not None:  # bitsandbytes' CUDA kernels, above the tracker
            from memfit.sim.kernels.bnb import BnbCudaKernels, bnb_cuda_patches

            kernels = BnbCudaKernels(self.tracker, autocast_dtype=self.low, compute_capability=cc,
                                     sm_count=self.gpu.sm_count if self.gpu is not None else None)
            contexts += [quiet_bnb_logs(), bnb_cuda_patches(), kernels]
        return contexts, kernels

    def run(self, *, optimizer_steps: int = 2, train: bool = True, optimizer_only: bool = False) -> Simulation:
        s = self.setup
        # Import what runs inside the CUDA emulation now: a first import under the tracker would record
        # module-level constants as allocations (peft's LoHa `torch.tensor(...)` class attributes,
        # imported by transformers.Trainer) and, on a fake run, leave them FakeTensors for good.
        import accelerate.utils  # noqa: F401  (convert_to_fp32 in _forward)
        from memfit.sim.optimizers import import_for

        import_for(s.optim)  # build_optimizer's imports (transformers.Trainer only where it is needed)

        contexts, kernels = self._cuda_emulation()
        with contextlib.ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            for context in contexts:
                stack.enter_context(context)
            stack.enter_context(self.tracker.module_scope(self.fwd_model, self.model, self.ref_model))
            self._materialize()
            trl_steps.materialize_reference(self)  # TRL: DPO's reference copy
            trl_steps.materialize_reward_model(self)  # TRL: GRPO's / RLOO's reward model
            self.optimizer = build_optimizer(self.model, s.optim, s.weight_decay)
            if optimizer_only:
                for _ in range(optimizer_steps):
                    self._fake_gradients()
                    self.optimizer_step()
                train = False
            micro = min(s.gradient_accumulation_steps, 2) if train else 0
            tell = _step_teller(micro, optimizer_steps if train else 0)
            first = len(self.tracker.events)
            for _ in range(micro):
                tell()
                self.micro_step(s.gradient_accumulation_steps)
            last = len(self.tracker.events)
            if train and optimizer_steps > 0:
                tell()
                self.optimizer_step()
            for _ in range(optimizer_steps - 1 if train else 0):
                # later optimizer steps repeat the first one's micro-steps exactly (the
                # gradients were freed by zero_grad); only the optimizer step differs
                # (its state now exists), so it is simulated again
                tell()
                self.tracker.phase = "forward"
                self.replay(first, last)
                self.optimizer_step()
            held = self.evaluate() if s.does_eval and not optimizer_only else 0
            trace = [e for e in self.tracker.trace() if e.category not in ("host", "paged")]
            paged = sum(r.size_bytes for r in self.tracker.records if r.category == "paged")
        params = {id(p): p for p in self.model.parameters()}
        total = sum(p.numel() for p in params.values())
        if self.quant_summary is not None:  # packed 4-bit weights hold several parameters per element
            total = parameter_count(self.model)
        trainable = sum(p.numel() for p in params.values() if p.requires_grad)
        config = getattr(self.model, "config", None)
        quantization = self._quant_report(kernels)
        if s.task == "ctc":  # the convolutions over raw audio: say so when they set the peak (sim.media_peak)
            from memfit.models.freezing import wants_frozen_feature_encoder
            from memfit.sim.media_peak import feature_encoder_note

            note = feature_encoder_note(trace, self.model, wants_frozen_feature_encoder(s))
            if note is not None:
                self.notes.append(note)
        media = None if self.media is None else self.media.summary
        if media is not None and trace:  # the peak's weights and activations by part of the model (sim.media_peak)
            from memfit.sim.media_peak import model_parts, parts_at_peak

            parts = model_parts(self.model, s.task)
            if parts:
                media = dict(media, parts_at_peak=[p.to_json() for p in parts_at_peak(trace, parts)])
        return Simulation(
            trace=trace, params=total, trainable_params=trainable, checkpointing=self.checkpointing,
            sdpa_backends=sorted(set(self.sdpa_backends)), notes=self.notes + list(s.notes),
            attn_kernels=sorted(set(self.flash_log or [])) + sorted(set(self.flex_log or [])) + self.liger_log,
            attn_implementation=getattr(config, "_attn_implementation", None),
            model_name=self.spec.name, model_type=getattr(config, "model_type", ""), eval_steps_held=held,
            weights_dtype=str(next(iter(params.values())).dtype).removeprefix("torch.") if params else "float32",
            quantization=quantization, paged_bytes=paged,
            media_inputs=media,
        )

    def _quant_report(self, kernels) -> dict | None:
        if self.quant_summary is None:
            return None
        out = dict(self.quant_summary)
        paths = sorted(kernels.gemm_paths) if kernels is not None else []
        out["gemm_4bit_paths"] = paths
        if "fallback-assumed" in paths:
            self.notes.append(
                "bitsandbytes gemm_4bit: at 5-1536 tokens per batch the CUDA kernel choice (fused vs dequantize + "
                "F.linear) depends on the GPU's SM count (backends/cuda/ops.py `_gemm_4bit_use_custom_cuda`), "
                "unknown without --gpu: memfit assumes the dequantizing path, the larger")
        if self.quant.bits == 8:
            self.notes.append("LLM.int8: the outlier columns depend on the values; memfit assumes none (their "
                              "fp16 copy `subA`, saved for backward, is usually a few columns)")
            if self.checkpointing and not (self.setup.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
                # bitsandbytes 0.50 autograd/_functions.py MatMul8bitLt.forward: `ctx.tensors = (CAt, subA, A)`
                self.notes.append(
                    "8-bit layers under non-reentrant checkpointing: bitsandbytes' MatMul8bitLt keeps each layer's "
                    "input for its backward as an attribute of the autograd context (`ctx.tensors`), which the "
                    "saved-tensor hooks of non-reentrant checkpointing never free, so checkpointing saves little "
                    "here; gradient_checkpointing_kwargs={\"use_reentrant\": true} frees them (its checkpointed "
                    "forward keeps no autograd context)")
        return out


def _step_teller(micro: int, optimizer_steps: int):
    """memfit.progress: `tell()` before each micro-step and optimizer step of a run says which one starts now."""
    steps = [f"micro-step {i + 1} of {micro}" for i in range(micro)]
    steps += [f"optimizer step {i + 1} of {optimizer_steps}" for i in range(optimizer_steps)]
    done = iter(range(len(steps)))

    def tell() -> None:
        i = next(done, len(steps) - 1)
        progress.report(f"simulating {steps[i]}", i, len(steps), detail=True)

    return tell


def simulate(
    setup: TrainSetup, *, fake: bool = True, optimizer_steps: int = 2, splice: bool = True, train: bool = True,
    optimizer_only: bool = False, gpu: GpuSpec | None = None,
) -> Simulation:
    """Simulate `setup` and return its allocation trace (see module docstring).

    `optimizer_steps=0` runs the micro-steps of one optimizer step without the step itself;
    `train=False` runs only the evaluation; `optimizer_only=True` gives the model the gradients a
    backward leaves and runs only the optimizer steps (the planner's cheap partial simulations).
    `splice=True` simulates 5 blocks per repeated stack and writes the trace of all of them
    (memfit.sim.splice); it falls back to the full model when the cut model cannot stand
    for it. `fake=False` runs on real CPU tensors (for exactness tests on small models).
    `gpu` is the target GPU (memfit.gpus.catalog): its compute capability (kernel choices) and SM
    count (bitsandbytes' 4-bit GEMM choice); None: the setup's compute capability, no SM count.
    """
    setup = resolve(setup)
    kwargs = dict(optimizer_steps=optimizer_steps, train=train, optimizer_only=optimizer_only)
    with isolated_simulation():
        if splice and not optimizer_only and trl_steps.wants_splice(setup):  # train=False: the evaluation
            try:
                return _Runner(setup, fake=fake, splice=True, gpu=gpu).run(**kwargs)
            except SpliceRefused:
                pass
        return _Runner(setup, fake=fake, splice=False, gpu=gpu).run(**kwargs)

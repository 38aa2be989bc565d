"""`resolve(setup)`: what a TrainSetup leaves to the model, read from the model and from peft.

A TrainSetup is a value record: it checks its own fields and imports neither transformers nor peft. What
needs them is done here, once, by each verb before it reads the setup (estimate, plan, the simulator,
a rank's simulation):

* the task, when none is given: `memfit.models.build.default_task` (the head of an `nn.Module`, else the
  config's architectures), with the sentence why added to the setup's notes;
* speech-seq2seq (Whisper): labels no longer than the decoder's `max_target_positions` when no target_length
  is given, with a note;
* a `peft_config` (a dict, a JSON string or a peft `PeftConfig`) read and checked by peft
  (`memfit.models.peft_methods.normalize_peft_config`), its notes added.

The setup is re-checked as a whole (`TrainSetup.replace`), so the checks that need the task (a TRL trainer
trains a causal LM) run on the resolved one.
"""

from __future__ import annotations

from memfit.train_setup import TrainSetup

__all__ = ["resolve"]


def resolve(setup: TrainSetup) -> TrainSetup:
    """`setup` with its task and `peft_config` resolved; `setup` itself when neither needs it."""
    changes = {}
    notes = list(setup.notes)
    if setup.peft_config is not None:
        from memfit.models.peft_methods import normalize_peft_config

        config, more = normalize_peft_config(setup.peft_config)
        if config != setup.peft_config or more:
            changes["peft_config"] = config
            notes += more
    if setup.task is None:  # it reads the model's config (a clear MemfitError when there is none)
        from memfit.models.build import default_task

        changes["task"], why = default_task(setup.model)
        notes.append(why)
    task = changes.get("task", setup.task)
    if task == "speech-seq2seq" and setup.target_length is None:  # Whisper's labels: at most its decoder positions
        from memfit.models.build import resolve_config

        limit = getattr(resolve_config(setup.model).config, "max_target_positions", None)
        if isinstance(limit, int) and setup.max_length > limit:
            changes["target_length"] = limit
            notes.append(f"labels of {limit} tokens: the decoder's `max_target_positions` (max_length "
                         f"{setup.max_length} is longer); --target-length sets another")
    return setup.replace(**changes, notes=notes) if changes else setup

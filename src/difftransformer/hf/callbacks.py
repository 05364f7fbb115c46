"""Callbacks for training the wrapper with transformers' `Trainer`.

`HeadNormRampCallback` does what our trainer does for a `diff_retrofit` model (a pretrained model made
differential by `difftransformer retrofit`, docs/interop.md): before each optimizer step s it raises every
layer's head-norm mix α to min(1, s / head_norm_ramp_steps), so training starts from the source model's
function and reaches DIFF V1's arithmetic after head_norm_ramp_steps steps. Without it α stays where the folder
stored it (0 after a retrofit: no head norm at all). It finds the wrapper inside whatever the Trainer trains
(a PEFT model included) and does nothing for other attention kinds. α is a buffer of the base model, which a PEFT
adapter does not save: after loading the base and the adapter again, call `model.set_training_step(steps_trained)`.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[HeadNormRampCallback()])
"""

from __future__ import annotations

from transformers import TrainerCallback

from difftransformer.hf.modeling import DiffTransformerForCausalLM


class HeadNormRampCallback(TrainerCallback):
    """Sets diff_retrofit's head-norm ramp from the Trainer's step count (`global_step`, the optimizer steps done,
    restored on resume) before every optimizer step and after it, as our trainer does, so the model saved after
    step s holds α for step s + 1 (`DiffTransformerForCausalLM.set_training_step`)."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        _set_step(model, state.global_step)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        _set_step(model, state.global_step)  # the Trainer counted the step just taken
        return control


def _set_step(model, step: int) -> None:
    wrappers = [] if model is None else [m for m in model.modules() if isinstance(m, DiffTransformerForCausalLM)]
    if model is not None and not wrappers:
        raise TypeError(f"HeadNormRampCallback ramps a DiffTransformerForCausalLM's head norm; the Trainer trains a "
                        f"{type(model).__name__} holding none. Drop the callback for other models")
    for wrapper in wrappers:
        wrapper.set_training_step(step)

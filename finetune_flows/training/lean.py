"""Two walks over the whole model that the Trainer makes on every micro-batch, made once.

Where training is host-bound (the Qwen3-0.6B shape on an H200: the GPU waits for the host), every millisecond the
host spends per micro-batch is a millisecond of the step. The Trainer spends some of it walking the model's modules
and parameters, which a QLoRA model with LoRA on every linear layer has thousands of (2,389 modules and 702
parameters for Qwen3's 28 layers):

- `floating_point_ops` (for the logged `total_flos`) counts the non-embedding parameters again for each micro-batch;
  here they are counted once. The figure is the same.
- `training_step` calls `model.train()` first, which sets the mode of every module; here the walk runs once, and
  again only after a call that left training (`eval()`, `train(False)`: the Trainer's evaluation). A model fresh from
  `from_pretrained` is in eval mode under a PEFT wrapper that is not, so the first walk is needed. A submodule's
  mode changed directly, not through the top module, would not be seen.
"""

from __future__ import annotations


def lean_trainer(trainer_class):
    """`trainer_class` (a transformers Trainer) counting the parameters for `total_flos` once per run."""

    class LeanTrainer(trainer_class):
        _flos_params: int | None = None

        def floating_point_ops(self, inputs) -> int:
            main = getattr(self.model, "main_input_name", "input_ids")
            if main not in inputs or not hasattr(self.model, "num_parameters"):
                return super().floating_point_ops(inputs)
            if self._flos_params is None:
                self._flos_params = self.model.num_parameters(exclude_embeddings=True)
            return 6 * inputs[main].numel() * self._flos_params

    LeanTrainer.__name__ = LeanTrainer.__qualname__ = f"Lean{trainer_class.__name__}"
    return LeanTrainer


def train_mode_once(model) -> None:
    """`model.train()` (or `train(True)`) walks the modules the first time, then only after a call that left
    training; `eval()` and `train(False)` walk them as before."""
    walk = model.train
    walked = False  # every module set to training by the last walk, and no walk out of it since

    def train(mode: bool = True):
        nonlocal walked
        if mode and walked:
            return model
        result = walk(mode)
        walked = mode
        return result

    model.train = train

"""Two walks over the whole model that the Trainer makes on every micro-batch, made once.

Where training is host-bound (the Qwen3-0.6B shape on an H200: the GPU waits for the host), every millisecond the
host spends per micro-batch is a millisecond of the step. The Trainer spends some of it walking the model's modules
and parameters, which a QLoRA model with LoRA on every linear layer has thousands of (2,389 modules and 702
parameters for Qwen3's 28 layers):

- `floating_point_ops` (for the logged `total_flos`) counts the non-embedding parameters again for each micro-batch;
  here they are counted once. The figure is the same.
- `training_step` calls `model.train()` first, which sets the mode of every module; here the walk is skipped while
  the top module is already training. Modes change through the top module (the Trainer's `model.eval()` for an
  evaluation, then `train()` again), so after any such change the walk runs as before.
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
    """`model.train()` (or `train(True)`) walks the modules only when the top module is not already training; every
    other call (`eval()`, `train(False)`) walks them as before."""
    walk = model.train

    def train(mode: bool = True):
        if mode and model.training:
            return model
        return walk(mode)

    model.train = train

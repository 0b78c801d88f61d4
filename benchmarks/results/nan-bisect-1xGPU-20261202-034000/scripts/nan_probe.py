"""Debug only: tasks.train_worker as one rank, with autograd anomaly detection from step NAN_PROBE_FROM on and a
check of every trainable gradient and of each decoder layer's output after each step."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import transformers  # noqa: E402

START = int(os.environ.get("NAN_PROBE_FROM", "0"))
_step = transformers.Trainer.training_step
_hooked = []


def _finite(t):
    return bool(torch.isfinite(t).all())


def _hook(name):
    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out) and not _finite(out):
            print(f"NANPROBE forward: non-finite output of {name} (max abs finite "
                  f"{out[torch.isfinite(out)].abs().max().item() if torch.isfinite(out).any() else 'none'})",
                  flush=True)
        elif torch.is_tensor(out) and name.endswith("norm") is False:
            pass
    return hook


def training_step(self, model, inputs, num_items_in_batch=None):
    step = self.state.global_step + 1
    if step < START:
        return _step(self, model, inputs, num_items_in_batch)
    if not _hooked:
        inner = getattr(model, "module", model)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        for i, layer in enumerate(base.model.layers):
            _hooked.append(layer.register_forward_hook(_hook(f"layer {i}")))
            _hooked.append(layer.self_attn.register_forward_hook(_hook(f"layer {i} self_attn")))
            _hooked.append(layer.mlp.register_forward_hook(_hook(f"layer {i} mlp")))
        _hooked.append(base.model.norm.register_forward_hook(_hook("final norm")))
    cu = inputs.get("cu_seq_lens_q")
    lens = torch.diff(cu).tolist() if cu is not None else None
    try:
        with torch.autograd.detect_anomaly(check_nan=True):
            loss = _step(self, model, inputs, num_items_in_batch)
    except RuntimeError as exc:
        print(f"NANPROBE step {step}: {exc}\nNANPROBE lens {lens}", flush=True)
        torch.save({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in inputs.items()},
                   os.path.join(os.environ.get("OUT", "/tmp"), f"nan_batch_step{step}.pt"))
        raise
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not _finite(p.grad)]
    big = max((p.grad.abs().max().item() for p in model.parameters() if p.grad is not None and _finite(p.grad)),
              default=0)
    w = max(p.detach().abs().max().item() for p in model.parameters() if p.requires_grad)
    print(f"NANPROBE step {step}: loss {loss.item():.4f}, non-finite grads {len(bad)} {bad[:2]}, max |grad| {big:.3g}, "
          f"max |lora w| {w:.3g}, rows {len(lens) if lens else '-'} longest {max(lens) if lens else '-'}", flush=True)
    return loss


transformers.Trainer.training_step = training_step
runpy.run_module("tasks.train_worker", run_name="__main__", alter_sys=True)

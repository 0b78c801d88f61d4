"""Debug only: which row of the NaN micro-batch makes non-finite gradients, and where (per-layer maxima)."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from tasks.attention import use_packed_attention  # noqa: E402
from tasks.config import FinetuneConfig  # noqa: E402
from tasks.environment import Plan  # noqa: E402
from tasks.planner import TrainingPlan  # noqa: E402
from tasks.train_worker import build_model  # noqa: E402

job = json.loads(Path(sys.argv[1]).read_text())
b = torch.load(sys.argv[2])
cfg = FinetuneConfig.model_validate(job["config"])
plan = Plan.model_validate(job["plan"])
tplan = TrainingPlan.model_validate(job["training_plan"])
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cuda":
    torch.cuda.set_device(0)
torch.manual_seed(0)
model = build_model(cfg, plan, tplan, Path(job["base"]), job["load_in_4bit"], {"": 0 if DEV == "cuda" else "cpu"}, False)
use_packed_attention(model, "torch_varlen" if DEV == "cuda" else "rows")
model.train()
for n, p in model.named_parameters():
    if "lora_B" in n:
        torch.nn.init.normal_(p, std=float(os.environ.get("LORA_B_STD", "1e-3")))
base = model.get_base_model()
layers = base.model.layers
fwd, bwd = {}, {}


def fhook(name):
    def h(m, a, o):
        o = o[0] if isinstance(o, tuple) else o
        f = o.detach().float()
        fwd[name] = (f.abs().max().item(), bool(torch.isfinite(f).all()), f.pow(2).mean(-1).sqrt().min().item())
    return h


def bhook(name):
    def h(m, gi, go):
        g = go[0]
        if g is not None:
            f = g.detach().float()
            fin = torch.isfinite(f)
            bwd[name] = (f[fin].abs().max().item() if fin.any() else float("nan"), bool(fin.all()))
    return h


hooks = [base.model.embed_tokens.register_forward_hook(fhook("embed"))]
for i, layer in enumerate(layers):
    hooks.append(layer.register_forward_hook(fhook(f"L{i}")))
    hooks.append(layer.register_full_backward_hook(bhook(f"L{i}")))
    hooks.append(layer.mlp.register_forward_hook(fhook(f"L{i}.mlp")))
    hooks.append(layer.mlp.register_full_backward_hook(bhook(f"L{i}.mlp")))
    hooks.append(layer.self_attn.register_forward_hook(fhook(f"L{i}.attn")))
hooks.append(base.model.norm.register_forward_hook(fhook("norm")))


def run(ids, labels, pos, packed, autocast=True):
    model.zero_grad(set_to_none=True)
    fwd.clear()
    bwd.clear()
    kw = dict(input_ids=ids[None].to(DEV), labels=labels[None].to(DEV), position_ids=pos[None].to(DEV))
    if packed is not None:
        cu, mx = packed
        kw.update(cu_seq_lens_q=cu.to(DEV), cu_seq_lens_k=cu.to(DEV), max_length_q=mx, max_length_k=mx)
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
        out = model(**kw)
    out.loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return out.loss.item(), bad


ids, labels, pos, cu = b["input_ids"][0] % model.config.vocab_size, b["labels"][0], b["position_ids"][0], b["cu_seq_lens_q"]
loss, bad = run(ids, labels, pos, (cu, int(b["max_length_q"])))
print(f"whole pack: loss {loss:.4f}, non-finite grads in {len(bad)} params {bad[:3]}", flush=True)
bounds = cu.tolist()
bad_rows = []
for r, (a, c) in enumerate(zip(bounds, bounds[1:])):
    loss, bad = run(ids[a:c], labels[a:c], pos[a:c], (torch.tensor([0, c - a], dtype=torch.int32), c - a))
    print(f"row {r} len {c - a}: loss {loss:.4f} non-finite {len(bad)}", flush=True)
    if bad:
        bad_rows.append((r, a, c))
emb = base.model.embed_tokens.weight.detach().float()
norms = emb.norm(dim=-1)
print(f"embedding norms: min {norms.min():.4g} max {norms.max():.4g} median {norms.median():.4g}; "
      f"ids<1024: min {norms[:min(1024, len(norms))].min():.4g} max {norms[:min(1024, len(norms))].max():.4g}", flush=True)
for r, a, c in bad_rows[:2]:
    run(ids[a:c], labels[a:c], pos[a:c], (torch.tensor([0, c - a], dtype=torch.int32), c - a))
    print(f"--- row {r}: ids {ids[a:c][:40].tolist()}...", flush=True)
    print("forward (max abs, finite, min token rms):", {k: (f"{v[0]:.3g}", v[1], f"{v[2]:.3g}") for k, v in fwd.items()})
    print("backward grad_output (max abs finite, all finite):", {k: (f"{v[0]:.3g}", v[1]) for k, v in bwd.items()})
    tok_norms = norms[ids[a:c]]
    print(f"row tokens' embedding norms: min {tok_norms.min():.4g} max {tok_norms.max():.4g}", flush=True)
    # a sliding search for the shortest prefix that fails
    lo, hi = 1, c - a
    while lo < hi:
        mid = (lo + hi) // 2
        _, bad = run(ids[a:a + mid], labels[a:a + mid], pos[a:a + mid], (torch.tensor([0, mid], dtype=torch.int32), mid))
        lo, hi = (lo, mid) if bad else (mid + 1, hi)
    print(f"shortest failing prefix of row {r}: {lo} tokens; last tokens {ids[a + lo - 8:a + lo].tolist()}", flush=True)
    _, bad = run(ids[a:a + lo], labels[a:a + lo], pos[a:a + lo], None)
    print(f"same prefix through sdpa (no cu_seqlens): non-finite {len(bad)}", flush=True)
    print("forward:", {k: (f"{v[0]:.3g}", v[1], f"{v[2]:.3g}") for k, v in fwd.items()})
    print("backward:", {k: (f"{v[0]:.3g}", v[1]) for k, v in bwd.items()})

"""Debug: step, loss, grad_norm from a log's train_log events, one line."""
import json
import sys

out = []
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("@@event ") and '"train_log"' in line:
        e = json.loads(line[8:])
        if "step" in e and "loss" in e:
            out.append(f"{e['step']}:{e['loss']:.3f}/{e.get('grad_norm')}")
print(" ".join(out[-int(sys.argv[2]):] if len(sys.argv) > 2 else out))

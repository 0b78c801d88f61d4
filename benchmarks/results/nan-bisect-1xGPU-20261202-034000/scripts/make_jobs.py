"""Debug: 2-rank jobs from a 1-GPU bench job, with training-plan switches. argv: src_job out_root name:k=v,..."""
import json
import os
import sys
from pathlib import Path

src = json.loads(Path(sys.argv[1]).read_text())
root = Path(sys.argv[2])
for spec in sys.argv[3:]:
    name, _, kv = spec.partition(":")
    job = json.loads(json.dumps(src))
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    job["out"], job["workdir"], job["fingerprint"] = str(out), str(out), name
    job["config"]["train"]["max_steps"] = int(os.environ.get("STEPS", 20))
    job["config"]["train"]["logging_steps"] = 1
    for item in filter(None, kv.split(",")):
        k, _, v = item.partition("=")
        v = json.loads(v)
        if k in ("liger", "upcast_frozen"):
            job[k] = v
        elif k.startswith("plan."):
            job["plan"][k[5:]] = v
        elif k.startswith("config."):
            sec, key = k.split(".")[1:]
            job["config"][sec][key] = v
        else:
            job["training_plan"][k] = v
    (out / "train.job.json").write_text(json.dumps(job))
    print(out / "train.job.json")

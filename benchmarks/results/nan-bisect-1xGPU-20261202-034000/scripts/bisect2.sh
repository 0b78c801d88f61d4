#!/bin/bash
# Debug (device), call 2: where does the NaN come from (anomaly detection), and does the rows kernel / a lower LR avoid it?
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/core/*.whl
printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S=/tmp/tb; mkdir -p $OUT/b2
timeout -k 20 150 python3 benchmarks/train_speed.py --shapes qwen3-0.6b --runs '' --steps 2 \
  --variant old:train.dequantize_base=false,train.compile=false --state $S --out $OUT/tb > $OUT/b2/bench.log 2>&1
echo "bench rc $?"
STEPS=30 python3 .carry/debug/make_jobs.py $S/out/ours-old-qwen3-0.6b/train.job.json /tmp/r1 \
  "probe:" "rows:plan.train_attn=\"eager\"" "lowlr:config.train.learning_rate=0.0002" "upcast:upcast_frozen=true"
SECONDS=0
NAN_PROBE_FROM=19 timeout -k 10 150 python3 -m torch.distributed.run --standalone --nproc_per_node=1 .carry/debug/nan_probe.py /tmp/r1/probe/train.job.json > $OUT/b2/probe.log 2>&1
echo "== probe rc $? ${SECONDS}s"
grep -a NANPROBE $OUT/b2/probe.log | cut -c1-600 | head -40
grep -a -B2 -A30 "Traceback of forward call that caused the error" $OUT/b2/probe.log | head -60
for n in rows lowlr upcast; do
  SECONDS=0
  timeout -k 10 100 python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m tasks.train_worker /tmp/r1/$n/train.job.json > $OUT/b2/$n.log 2>&1
  echo "== $n rc $? ${SECONDS}s"
  python3 .carry/debug/curve.py $OUT/b2/$n.log
  grep -E "^training:|^trained" $OUT/b2/$n.log | head -3
done

#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/core/*.whl
printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S=/tmp/tb; mkdir -p $OUT/b3
timeout -k 20 150 python3 benchmarks/train_speed.py --shapes qwen3-0.6b --runs '' --steps 2 \
  --variant old:train.dequantize_base=false,train.compile=false --state $S --out $OUT/tb > $OUT/b3/bench.log 2>&1
echo "bench rc $?"
timeout -k 10 200 python3 .carry/debug/diag.py $S/out/ours-old-qwen3-0.6b/train.job.json .carry/debug/nan_batch_step24.pt > $OUT/b3/diag.log 2>&1
echo "diag rc $?"; grep -v Warning $OUT/b3/diag.log | grep -a -v "^ *warnings\|^$" | cut -c1-3000 | tail -60

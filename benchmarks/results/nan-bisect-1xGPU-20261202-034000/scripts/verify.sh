#!/bin/bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/core/*.whl
printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S=/tmp/tb; mkdir -p $OUT/v
SECONDS=0
timeout -k 20 170 python3 benchmarks/train_speed.py --shapes qwen3-0.6b --runs '' --steps 40 \
  --variant old:train.dequantize_base=false,train.compile=false --state $S --out $OUT/tb > $OUT/v/bench.log 2>&1
echo "bench rc $? ${SECONDS}s"; grep "tokens/s" $OUT/v/bench.log | head -3
cp $S/out/ours-old-qwen3-0.6b/train.log $OUT/v/old-1gpu-40.train.log
python3 .carry/debug/curve.py $OUT/v/old-1gpu-40.train.log
STEPS=30 python3 .carry/debug/make_jobs.py $S/out/ours-old-qwen3-0.6b/train.job.json /tmp/r2 "old2:"
SECONDS=0
timeout -k 10 90 python3 -m torch.distributed.run --standalone --nproc_per_node=2 .carry/debug/share_gpu_rank.py /tmp/r2/old2/train.job.json > $OUT/v/old2.log 2>&1
echo "== 2 ranks rc $? ${SECONDS}s"; python3 .carry/debug/curve.py $OUT/v/old2.log; grep -E "^trained" $OUT/v/old2.log

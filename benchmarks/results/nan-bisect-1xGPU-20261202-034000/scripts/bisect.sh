#!/bin/bash
# Debug (device): is the 2-GPU NaN data (packs 20-39 on one GPU) or the multi-rank path (2 ranks sharing cuda:0)?
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/core/*.whl
printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
S=/tmp/tb; mkdir -p $OUT/bisect
timeout -k 20 230 python3 benchmarks/train_speed.py --shapes qwen3-0.6b --runs '' --steps 40 \
  --variant old:train.dequantize_base=false,train.compile=false --state $S --out $OUT/tb > $OUT/bisect/bench.log 2>&1
echo "bench rc $?"; tail -5 $OUT/bisect/bench.log
cp $S/out/ours-old-qwen3-0.6b/train.log $OUT/bisect/old-1gpu-40.train.log 2>/dev/null
python3 .carry/debug/curve.py $OUT/bisect/old-1gpu-40.train.log
python3 .carry/debug/make_jobs.py $S/out/ours-old-qwen3-0.6b/train.job.json /tmp/r2 \
  "old:" "new:dequantize_base=true,compile_layers=true" "noliger:liger=false"
for n in old new noliger; do
  d=/tmp/r2/$n
  SECONDS=0
  timeout -k 10 $([ $n = new ] && echo 140 || echo 90) python3 -m torch.distributed.run --standalone --nproc_per_node=2 .carry/debug/share_gpu_rank.py $d/train.job.json > $OUT/bisect/$n.log 2>&1
  echo "== $n rc $? ${SECONDS}s"
  python3 .carry/debug/curve.py $OUT/bisect/$n.log
  grep -E "^training:|^trained|Error|error" $OUT/bisect/$n.log | head -5
done

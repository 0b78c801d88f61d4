set -u
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../core/*.whl
printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt
git_rev=$(cat REV 2>/dev/null); echo "rev $git_rev" >> $R/gpu.txt
COMMON="--set model.source=generated:qwen3-0.6b --set data.builtin_examples=2000 --set data.max_length=256 \
  --set train.max_steps=60 --set train.save_steps=20 --set train.logging_steps=5 --set train.per_device_batch_size=16 \
  --set train.learning_rate=5e-4 --set eval.max_samples=50 --set eval.batch_size=50 --set hardware.gpus=0 \
  --set export.merge=false --set run.cache_dir=/tmp/ccache --set run.output_dir=/tmp/cruns"
start=$(date +%s)
for s in 1 2; do
  echo "== run$s start $(date -u +%T)" >> $R/times.txt
  TORCH_LOGS=recompiles timeout -k 20 200 python3 flows/finetune.py $COMMON --set train.seed=$s --set run.name=seed$s > $R/run$s.log 2>&1
  echo "== run$s rc $? end $(date -u +%T)" >> $R/times.txt
done
left=$(( 560 - ($(date +%s) - start) ))
echo "left $left" >> $R/times.txt
if [ $left -gt 60 ]; then
  echo "== run3 start $(date -u +%T)" >> $R/times.txt
  timeout -k 10 $left python3 flows/finetune.py $COMMON --set train.seed=3 --set train.compile=false --set run.name=nocompile3 > $R/run3.log 2>&1
  echo "== run3 rc $? end $(date -u +%T)" >> $R/times.txt
fi
du -sh /tmp/ccache/compile/* >> $R/times.txt 2>&1
find /tmp/cruns -name '*.log' -o -name '*.json' -o -name '*.md' | grep -v checkpoint | tar -cf $R/runs.tar -T - 2>/dev/null
tar -czf $OUT/call1.tgz -C $OUT r

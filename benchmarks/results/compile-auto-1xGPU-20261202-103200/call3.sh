set -u
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../core/*.whl
printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt; cat REV >> $R/gpu.txt
C="--set model.source=generated:qwen3-0.6b --set data.builtin_examples=2000 --set data.max_length=256 \
  --set train.save_steps=20 --set train.logging_steps=1 --set train.per_device_batch_size=16 --set train.max_steps=8 \
  --set train.learning_rate=5e-4 --set eval.max_samples=8 --set eval.batch_size=8 --set hardware.gpus=0 \
  --set train.compile=true --set export.merge=false --set run.cache_dir=/tmp/c3cache --set run.output_dir=/tmp/c3runs"
left() { echo $(( 370 - ($(date +%s) - start) )); }
mark() { echo "== $1 $(date -u +%T) left $(left)" >> $R/times.txt; }
for s in 1 2; do
  mark "run$s start"
  timeout -k 5 $(( $(left) - 5 )) python3 flows/finetune.py $C --set train.seed=$s --set run.name=compiled$s > $R/run$s.log 2>&1; mark "run$s rc=$?"
  tar -czf $OUT/call3.tgz -C $OUT r
done
du -sh /tmp/c3cache/compile/*/* >> $R/times.txt 2>&1
tar -czf $OUT/call3.tgz -C $OUT r

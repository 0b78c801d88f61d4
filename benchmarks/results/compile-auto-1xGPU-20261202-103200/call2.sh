set -u
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../core/*.whl
printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt; cat REV >> $R/gpu.txt
C="--set model.source=generated:qwen3-0.6b --set data.builtin_examples=2000 --set data.max_length=256 \
  --set train.save_steps=20 --set train.logging_steps=5 --set train.per_device_batch_size=16 \
  --set train.learning_rate=5e-4 --set eval.max_samples=50 --set eval.batch_size=50 --set hardware.gpus=0 \
  --set export.merge=false --set run.cache_dir=/tmp/c2cache --set run.output_dir=/tmp/c2runs"
left() { echo $(( 575 - ($(date +%s) - start) )); }
mark() { echo "== $1 $(date -u +%T) left $(left)" >> $R/times.txt; }
mark "A(compile=false,60) start"
timeout -k 10 240 python3 flows/finetune.py $C --set train.max_steps=60 --set train.seed=3 --set train.compile=false --set run.name=eager60 > $R/A.log 2>&1; mark "A rc=$?"
mark "B(auto,60) start"
timeout -k 10 130 python3 flows/finetune.py $C --set train.max_steps=60 --set train.seed=4 --set run.name=auto60 > $R/B.log 2>&1; mark "B rc=$?"
TV=$(python3 -c "import torch; print(torch.__version__)")
REC=/tmp/c2cache/compile/NVIDIA-H200-sm90/compile-seconds.json
mkdir -p $(dirname $REC); echo "{\"qwen3-1024-torch$TV\": 20.0}" > $REC; cp $REC $R/record-before.json
ls /tmp/c2cache/compile/ >> $R/times.txt
mark "C(auto,300,record 20 s) start"
timeout -k 10 $(( $(left) - 15 )) python3 flows/finetune.py $C --set train.max_steps=300 --set train.save_steps=100 --set train.seed=5 --set run.name=auto300 > $R/C.log 2>&1; mark "C rc=$?"
cp $REC $R/record-after.json 2>/dev/null
du -sh /tmp/c2cache/compile/* >> $R/times.txt 2>&1
find /tmp/c2runs /tmp/c2cache/adapters -name 'train_metrics.json' -o -name 'summary.json' -o -name 'train.log' | grep -v checkpoint | tar -cf $R/runs.tar -T - 2>/dev/null
tar -czf $OUT/call2.tgz -C $OUT r

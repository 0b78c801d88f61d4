#!/bin/bash
# One lent-machine call of the training bench (benchmarks/README.md): installs the `bench` wheel set (carry
# .carry/bench) once per machine, with a compile cache a former call returned if .carry/bench holds one; runs each
# further argument as one bench invocation, all sharing --state /tmp/tb, within LIMIT seconds of the call; returns
# under $OUT/x the log, the report, the rows' logs (no weights) and the compile cache for the next session
# (benchmarks/compile_cache.sh: copy its parts into .carry/bench).
#   bash benchmarks/device_call.sh 560 1 "--shapes qwen3-8b --runs ours,unsloth,trl --budgets 24" "..."
LIMIT=$1; TAG=$2; shift 2
mkdir -p $OUT/x
if [ ! -e /tmp/site/.done ]; then
  (cd .carry/bench && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $(cat site.txt) \
    && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/peers $(cat peers.txt)) && touch /tmp/site/.done
  printf "import site\nsite.addsitedir('/tmp/site')\n" > /tmp/site/sitecustomize.py
  if ls .carry/bench/compile-cache.tar.xz* >/dev/null 2>&1; then
    bash benchmarks/compile_cache.sh unpack /tmp/tb/cache .carry/bench/compile-cache.tar.xz*
  fi
fi
echo "installed at $SECONDS s"
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
i=0
for args in "$@"; do
  i=$((i+1)); left=$((LIMIT-SECONDS))
  [ $left -lt 30 ] && { echo "skipped (no time): $args"; continue; }
  echo "== [$SECONDS s] $args" | tee -a $OUT/x/bench-$TAG.log
  timeout -k 15 $left python3 benchmarks/train_speed.py --peer-site /tmp/peers --state /tmp/tb --out $OUT/x/tb $args \
    >> $OUT/x/bench-$TAG.log 2>&1
  echo "   rc $? at $SECONDS s" | tee -a $OUT/x/bench-$TAG.log
done
grep -h "tokens/s\|FAILED\|ready in" $OUT/x/bench-$TAG.log | cut -c1-300
tar czf $OUT/x/logs-$TAG.tgz -C /tmp/tb --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' --exclude='*.pth' out 2>/dev/null
bash benchmarks/compile_cache.sh pack /tmp/tb/cache $OUT/x/compile-cache.tar.xz. 2>/dev/null
ls -la $OUT/x

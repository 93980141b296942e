#!/bin/bash
# Before and after, interleaved in one run: OLD is a checkout of the code before every
# run's data parallelism went through one call (sync/data_parallel.py), NEW this one;
# both with this .venv.  Plain data parallelism over the ring at P = 2 beside DDP, the
# dp2 x pp2 grid over the ring (bench_parallel --part overlap), a whole MLP through one
# parameter server (2 workers + 1 server: one push after backward before, a push per
# bucket from the comm thread now), and the dp2 x pp2 grid through one server.
set -u
OLD=${OLD:?a checkout of the previous code} NEW=${NEW:-$PWD} OUT=${OUT:-results/one-call}
mkdir -p $OUT
export OMP_NUM_THREADS=1 PATH=$NEW/.venv/bin:$PATH
PY=$NEW/.venv/bin/python
PS_MLP="--sync ps --servers 1 --consistency bsp --model mlp --width 1024 --depth 4 \
  --global-batch 32 --steps 25 --threads 1 --no-progress"
for round in 1 2 3; do
  for tree in old new; do
    dir=$OLD; [ $tree = new ] && dir=$NEW
    cd $dir
    echo "== round $round $tree plain P=2 $(cat /proc/loadavg)"
    timeout 300 mpiexec -n 2 $PY -m mpi4py -m strategies.bench --syncs ring,ddp --model mlp \
        --width 1024 --depth 4 --global-batch 32 --rounds 3 --steps-per-round 5 \
        --jsonl $OUT/plain_$tree.jsonl 2>&1 | tail -4
    echo "== round $round $tree dp2xpp2 $(cat /proc/loadavg)"
    timeout 300 mpiexec -n 4 $PY -m mpi4py -m strategies.bench_parallel --part overlap \
        --rounds 1 --steps 6 --jsonl $OUT/grid_$tree.jsonl 2>&1 | tail -3
    echo "== round $round $tree ps whole MLP $(cat /proc/loadavg)"
    timeout 300 mpiexec -n 3 $PY -m mpi4py -m strategies.train $PS_MLP \
        --jsonl $OUT/ps_$tree.r$round.jsonl 2>&1 | tail -2
  done
  cd $NEW
  echo "== round $round servers $(cat /proc/loadavg)"
  timeout 300 mpiexec -n 5 $PY -m mpi4py -m strategies.bench_parallel --part servers \
      --rounds 1 --steps 6 --jsonl $OUT/servers.jsonl 2>&1 | tail -3
done

#!/bin/bash
# Before and after, interleaved in one run: OLD is a checkout of the code before the
# parameter servers went under the splits, NEW this one; both with this .venv.
# Plain data parallelism over the ring at P = 2 beside DDP, the dp2 x pp2 grid over the
# ring (--part overlap), and the same grid through one server (--part servers, NEW only).
set -u
OLD=${OLD:?a checkout of the previous code} NEW=${NEW:-$PWD} OUT=${OUT:-results/servers-grid}
mkdir -p $OUT
export OMP_NUM_THREADS=1 PATH=$NEW/.venv/bin:$PATH
PY=$NEW/.venv/bin/python
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
  done
  cd $NEW
  echo "== round $round servers $(cat /proc/loadavg)"
  timeout 300 mpiexec -n 5 $PY -m mpi4py -m strategies.bench_parallel --part servers \
      --rounds 1 --steps 6 --jsonl $OUT/servers.jsonl 2>&1 | tail -3
done

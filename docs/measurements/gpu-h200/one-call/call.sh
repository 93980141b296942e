#!/usr/bin/env bash
# one device call: the tier, fp16 vs bf16, bf16 local vs bare (more rounds), the planner's axes
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}
t0=$SECONDS
{ nvidia-smi -L; python3 -c 'import torch, sys; print(torch.__version__, torch.version.cuda, sys.version.split()[0])'; nproc; uptime; } > $O/card.txt 2>&1
PYTEST_ADDOPTS="--durations=12 -rs" timeout 290 tests/gpu/run.sh .whl > $O/tier.log 2>&1
echo "tier rc $? after $((SECONDS - t0)) s" | tee -a $O/tier.log
STEPS="3" timeout 95 tests/gpu/figures.sh $O > /dev/null 2>&1
echo "step 3 rc $? at $((SECONDS - t0)) s" | tee -a $O/commands.log
cmd=(.venv-gpu/bin/python -m strategies.bench --syncs local,bare --model gpt --layers 8 --d-model 512 --heads 8 --seq-len 256 --global-batch 32 --precision bf16 --device cuda --rounds 11 --steps-per-round 10 --warmup 3 --jsonl $O/local_vs_bare.jsonl)
echo "+ ${cmd[*]}" >> $O/commands.log
timeout 45 "${cmd[@]}" >> $O/output.log 2>&1
echo "bf16 local/bare rc $? at $((SECONDS - t0)) s" | tee -a $O/commands.log
left=$((585 - (SECONDS - t0)))
STEPS="5" timeout $left tests/gpu/figures.sh $O > /dev/null 2>&1
echo "step 5 rc $? at $((SECONDS - t0)) s (limit $left)" | tee -a $O/commands.log
grep -h "passed\|failed" $O/tier.log | tail -3
grep -h "fp16\|bf16" $O/output.log | grep -i "ring \|local \|bare " | tail -12
grep -h "measured / predicted" $O/output.log | tail -8

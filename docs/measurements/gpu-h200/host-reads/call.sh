#!/usr/bin/env bash
# second device call: the step's host reads ride on its one wait; fp16 against bf16 again
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}
t0=$SECONDS
{ nvidia-smi -L; uptime; } > $O/card.txt 2>&1
PYTEST_ADDOPTS="-k 'step_waits or fp16_device' -rA" timeout 90 tests/gpu/run.sh .whl > $O/tier.log 2>&1
echo "tier subset rc $? after $((SECONDS - t0)) s" | tee -a $O/tier.log
STEPS="3" timeout 100 tests/gpu/figures.sh $O > /dev/null 2>&1
echo "step 3 rc $? at $((SECONDS - t0)) s" | tee -a $O/commands.log
cmd=(.venv-gpu/bin/python -m strategies.bench --syncs local,bare --model gpt --layers 8 --d-model 512 --heads 8 --seq-len 256 --global-batch 32 --precision bf16 --device cuda --rounds 11 --steps-per-round 10 --warmup 3 --jsonl $O/local_vs_bare.jsonl)
echo "+ ${cmd[*]}" >> $O/commands.log
timeout 40 "${cmd[@]}" >> $O/output.log 2>&1
echo "bf16 local/bare rc $? at $((SECONDS - t0)) s" | tee -a $O/commands.log
grep -h "passed\|failed" $O/tier.log | tail -3
grep -h "^ring \|^local \|^bare " $O/output.log

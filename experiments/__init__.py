"""Experiments on top of allreduce/, psrv/ and strategies/: sweeps, cost model, plots, labs.

    python -m experiments.sweep experiments/demo.toml     # run a matrix -> results/demo/
    python -m experiments.report results/demo             # plots + report.md / report.html
    python -m experiments.calibrate --out results           # results/calibration.json: α, β, γ
    python -m experiments.simulate                        # 8..4096 ranks, two-level cluster
    mpiexec -n 4 python -m mpi4py -m allreduce.bench --algos ring,tree --link-latency-us 100
    experiments/labs/README.md                            # five lab sheets and their checks

Modules: sweep (runner) and sweepfile (the TOML and its checks), records (results
directory, provenance), costmodel (formulas), calibrate, fidelity (predicted vs
measured), simulate, plots (one function per figure), report.  Slow links and stragglers are
flags of the commands themselves (--link-latency-us, --link-gbps, --straggler).
"""

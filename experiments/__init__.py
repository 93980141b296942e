"""Experiments on top of allreduce/, psrv/ and strategies/: sweeps, cost model, plots, labs.

    python -m experiments.sweep experiments/demo.toml     # run a matrix -> results/demo/
    python -m experiments.report results/demo             # plots + report.md / report.html
    python -m experiments.calibrate --out results           # results/calibration.json: α, β, γ
    python -m experiments.simulate                        # 8..4096 ranks, two-level cluster
    mpiexec -n 4 python -m mpi4py -m allreduce.bench --algos ring,tree --link-latency-us 100
    experiments/labs/README.md                            # ten lab sheets and their checks

Modules: sweep (runner), sweepfile (the TOML and its checks), launchers and points
(where and how a point runs), cluster/ (the emulated multi-host cluster), records
(results directory, provenance), costmodel (formulas), calibrate (one host;
calibrate_ps for psrv, calibrate_link for the link between hosts, fits for the
alpha-beta fits they share), fidelity (predicted vs measured), simulate, the figures
(plots, training_plots, cluster_figures and one module per technique's figure, on
palette), report.  Slow links and stragglers are flags of the commands themselves
(--link-latency-us, --link-gbps, --straggler).
"""

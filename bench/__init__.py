"""leapctl's benchmarks, one harness (`bench.harness`) and these entry points, each run from the repository
root as a module (`--help` on any of them lists its options):

- `python -m bench.quality STUDY`: perplexity studies (prune, q4, grid, head, int8, tune, objective);
- `python -m bench.kernels --format F --phase P [--isa I]`: one kernel against its dense baselines
  (`--base REV`: two builds of the int8 op side by side);
- `python -m bench.serve --format F`: served decode and prefill, every server in turn or in interleaved
  rounds;
- `python -m bench.learn_speed`, `python -m bench.formats`, `python -m bench.pareto`,
  `python -m bench.gpu_check`.

Results: `bench/results/<topic>/`, summarised in `bench/results/README.md`."""

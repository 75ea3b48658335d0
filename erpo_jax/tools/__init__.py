"""Tools over the library: benchmarks, TPU plans, sweeps, reports and the demo."""

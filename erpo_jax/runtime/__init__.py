"""Process runtime: host memory and XLA options, the compilation cache, multi-host start-up, run-directory I/O."""

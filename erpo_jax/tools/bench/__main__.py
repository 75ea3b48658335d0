"""python -m erpo_jax.tools.bench (see the package docstring)."""

from erpo_jax.tools.bench import main

main()

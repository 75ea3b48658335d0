"""The error every layer raises for a bad config field, file, flag or path.

It sits at the bottom of the package so that `runtime` (run directories, run
locks) can raise it without importing the config module above it;
`erpo_jax.train.config` re-exports it."""


class ConfigError(ValueError):
    """A bad config field, config file or override: `erpo` reports it in one
    sentence and exits with code 2."""

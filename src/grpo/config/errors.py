"""`ConfigError`: the one error a bad config value, file or input row raises.

Its message names the key (or the file or row) and the fix; the CLI prints it as one
`grpo:` line and exits 2. It lives alone so that every layer, the config itself and the
registry included, can raise it without importing anything else.
"""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""

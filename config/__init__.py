"""atoll's one config, at the bottom of the package: every engine default and behaviour
switch is a field of the frozen EngineConfig (engine.py), read once at start-up from CLI
flags (cli.py), `LLM(...)` keywords or the environment (env.py), and passed down. This
package imports nothing of atoll but errors."""

from atoll.config.cli import add_cli_options, add_model_options, from_args
from atoll.config.engine import (DEVICES, DISPATCH, DTYPES, KERNEL_MODES, MOE_EXCHANGES, EngineConfig,
                                 default_batched_tokens, default_cache_dir)
from atoll.config.env import ENV_VARS, env_overrides, resolve

__all__ = ["DEVICES", "DISPATCH", "DTYPES", "ENV_VARS", "EngineConfig", "KERNEL_MODES", "MOE_EXCHANGES",
           "add_cli_options", "add_model_options", "default_batched_tokens", "default_cache_dir", "env_overrides", "from_args", "resolve"]

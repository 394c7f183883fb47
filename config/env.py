"""The environment's part of the config: the only place atoll reads its own ATOLL_*
variables. Precedence: an explicit flag or keyword, else the variable, else the default."""

from __future__ import annotations

import os
from dataclasses import fields

from atoll.config.engine import EngineConfig
from atoll.errors import ConfigError

# field -> variable; each variable sets its field's default for this process
ENV_VARS = {
    "enforce_eager": "ATOLL_ENFORCE_EAGER",
    "compile": "ATOLL_COMPILE",
    "compile_freezing": "ATOLL_COMPILE_FREEZING",
    "kernels": "ATOLL_KERNELS",
    "moe_exchange": "ATOLL_MOE_EXCHANGE",
    "moe_gather_rows": "ATOLL_MOE_GATHER_ROWS",
    "mkl_pack": "ATOLL_MKL_PACK",
    "collective_timeout_s": "ATOLL_COLLECTIVE_TIMEOUT_S",
    "cache_dir": "ATOLL_CACHE",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(name: str, kind: str, text: str):
    var, value = ENV_VARS[name], text.strip()
    if kind == "bool":
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise ConfigError(f"{var}={text!r} must be 1 or 0 (true/false, yes/no, on/off)")
    if kind.startswith("int"):
        if not value.isdigit():
            raise ConfigError(f"{var}={text!r} must be a whole number")
        return int(value)
    if kind.startswith("float"):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{var}={text!r} must be a number") from None
    return value.lower() if name in ("kernels", "moe_exchange", "compile") else value


def env_overrides(environ=None) -> dict:
    """The fields the environment sets (empty variables set nothing)."""
    environ = os.environ if environ is None else environ
    kinds = {f.name: str(f.type).split(" ")[0] for f in fields(EngineConfig)}
    out = {}
    for name, var in ENV_VARS.items():
        text = environ.get(var)
        if text is not None and text.strip():
            out[name] = _parse(name, kinds[name], text)
    return out


def resolve(options: dict | None = None, environ=None) -> EngineConfig:
    """EngineConfig from explicit options over the environment over the defaults."""
    given = dict(options or {})
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ConfigError(f"unknown engine option {unknown[0]!r}; known: {', '.join(sorted(names))}")
    return EngineConfig(**{**env_overrides(environ), **given})

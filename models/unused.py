"""Checkpoint tensors a family's model reads nothing from, by design. Strict loading
(models/checkpoint.py) skips these unread; any other tensor that no rank reads is an error.

UNUSED maps a model_type to its rules; a rule is a regular expression the whole tensor name
must match, or a function (name, config) -> bool. A family with tensors to skip adds them
here, with a note saying why.
"""

from __future__ import annotations

import re

from atoll.models.kv_scales import is_checkpoint_scale

# rotary frequencies saved as buffers by older checkpoints; atoll computes its own
ROTARY = r"(.+\.)?rotary_emb\.inv_freq"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def after_last_layer(name: str, config) -> bool:
    """DeepSeek's multi-token-prediction layers, stored as decoder layers numbered from
    num_hidden_layers on (the official V3 checkpoint's layer 61): the target model reads none
    of them; only the deepseek_mtp drafter loads them, into its own module (models/mtp.py)."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers


UNUSED = {
    "llama": (ROTARY,),
    "mistral": (ROTARY,),
    "qwen2": (ROTARY,),
    "qwen3": (ROTARY,),
    "mixtral": (ROTARY,),
    "qwen2_moe": (ROTARY,),
    "qwen3_moe": (ROTARY,),
    "deepseek_v2": (ROTARY, after_last_layer),
    "deepseek_v3": (ROTARY, after_last_layer),
}


def known_unused(name: str, config) -> bool:
    """Whether checkpoint tensor `name` is one its family's model never reads (a KV cache scale,
    k_scale/v_scale: the cache reads those, models/kv_scales.py, no parameter does)."""
    if is_checkpoint_scale(name):
        return True
    for rule in UNUSED.get(config.model_type, ()):
        if rule(name, config) if callable(rule) else re.fullmatch(rule, name):
            return True
    return False

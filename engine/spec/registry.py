"""The drafters by method name ({"method": ...} in --speculative-config, vLLM's spelling). A
drafter is a Drafter subclass with a `method` and a `check`; a new one is a module of its own and
a line here. The scheduler hands a drafter its decoding chunks after scheduling the running
sequences; the drafter extends each with up to K drafted tokens (growing its block table for
them), so the step's one forward verifies them (engine.sample.verify). Every rank of a replica
drafts the same tokens."""

from __future__ import annotations

from atoll.config.speculative import SpeculativeConfig
from atoll.engine.spec.draft_model import DraftModelDrafter
from atoll.engine.spec.drafter import Drafter
from atoll.engine.spec.eagle3 import Eagle3Drafter
from atoll.engine.spec.layer_skip import LayerSkipDrafter
from atoll.engine.spec.lookahead import LookaheadDrafter
from atoll.engine.spec.mtp import MtpDrafter
from atoll.engine.spec.ngram import NgramDrafter

DRAFTERS: dict[str, type[Drafter]] = {d.method: d for d in (NgramDrafter, LayerSkipDrafter, DraftModelDrafter,
                                                            MtpDrafter, LookaheadDrafter, Eagle3Drafter)}


def check(cfg: SpeculativeConfig | None, layout, config, model_dir) -> None:
    """A one-line error when the config cannot run on this layout, model and checkpoint, before
    any rank starts."""
    if cfg is not None:
        DRAFTERS[cfg.method].check(cfg, layout, config, model_dir)


def make_drafter(cfg: SpeculativeConfig | None, runner, *, max_model_len: int) -> Drafter | None:
    """This rank's drafter for the config, or None when speculation is off."""
    if cfg is None:
        return None
    return DRAFTERS[cfg.method](cfg, max_model_len=max_model_len, runner=runner)

"""Errors a user can cause. The CLI prints their one line and exits 2."""


class AtollError(Exception):
    """Base for every error caused by user input or the environment."""


class ConfigError(AtollError):
    """A model config, topology or option that atoll cannot use."""


class LayoutError(AtollError):
    """A parallel layout that the model or the world size does not admit."""


class CheckpointError(AtollError):
    """A checkpoint directory or file that is missing, incomplete or corrupt."""


class InputError(AtollError):
    """A prompt or request that cannot be served (empty file, too long, bad JSON)."""


class LaunchError(AtollError):
    """Ranks could not be started, or a launcher's package is missing."""


class RankFailure(AtollError):
    """A rank raised or died; carries which one and why. died: the launcher saw the rank's
    process end or freeze (not an error the rank raised itself), so its peers may go on
    without it (--elastic-ep)."""

    def __init__(self, rank: int, cause: str, node: str | None = None, *, died: bool = False):
        where = f"rank {rank}" + (f" on {node}" if node else "")
        super().__init__(f"{where} failed: {cause}")
        self.rank = rank
        self.cause = cause
        self.node = node
        self.died = died


class ExpertLost(AtollError):
    """An MoE expert whose every copy sat on lost ranks and that no checkpoint can load again."""

    def __init__(self, layer: int, expert: int, lost: list[int]):
        super().__init__(f"expert {expert} of MoE layer {layer} has no source: its every copy was on the lost "
                         f"ep rank(s) {lost} and the checkpoint cannot load it; the engine cannot go on without it")
        self.layer, self.expert, self.lost = layer, expert, lost

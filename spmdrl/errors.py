"""Errors a user can cause. Each carries a one-line message naming the key, file or row and a fix."""


class SpmdrlError(Exception):
    """Base class of every user-facing spmdrl error (bad config, data, paths, checkpoints, user code)."""


class ConfigError(SpmdrlError):
    """A config file, key, value or override is wrong."""


class DataError(SpmdrlError):
    """A dataset file, column or row is wrong."""


class RewardError(SpmdrlError):
    """A reward function failed or returned something unusable."""


class LayoutError(ConfigError):
    """The requested parallel layout does not fit the world."""


class CheckpointError(SpmdrlError):
    """A checkpoint is missing, corrupted or does not match the run."""


class HookError(SpmdrlError):
    """A user hook raised."""


class Stopped(SpmdrlError):
    """A rank stopped by a signal (SIGTERM, Ctrl-C): one line, but not a user error (exit 128 + signum)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def summary(e: BaseException, width: int = 240, lines: int = 2) -> str:
    """An exception as one line: its type and the first `lines` lines of its message joined, cut at `width`
    characters (a library's failure quoted inside spmdrl's own one-line errors)."""
    text = " ".join(ln.strip() for ln in str(e).strip().splitlines()[:lines] if ln.strip())
    return f"{type(e).__name__}: {text[:width]}"

"""The exceptions and warnings of checkpoint loading."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded as requested (unsafe content, corrupt file, layout or shape
    mismatch). The message always names the file/key concerned and what to do."""


class UnsafePickleWarning(UserWarning):
    """Emitted when a checkpoint is loaded with unrestricted unpickling (explicit opt-in)."""

"""nybble's own exception types (bad values and shapes raise ValueError, unknown names KeyError)."""


class FormatError(ValueError):
    """A file or state dict is malformed: missing keys, wrong sizes, unreadable metadata."""

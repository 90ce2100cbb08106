"""Writing files safely (nybble/_files.py): every writer outside the checkpoint tools killed at
every filesystem operation."""

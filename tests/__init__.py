"""nybble's tests, one folder per area of the package (docs/testing.md, "Layout"); the
helpers every area shares (conftest.py, strategies.py, fuzzing.py, pretrained_fixtures.py,
fixtures/, cuda_emulator/) stay here and are imported as `tests.<module>`."""

from pathlib import Path

#: This folder, the repository's root, and the golden files every area reads.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"

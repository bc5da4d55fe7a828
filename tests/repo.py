"""The repository's root, for tests that run its scripts or read its files wherever they sit in tests/."""
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parent.parent

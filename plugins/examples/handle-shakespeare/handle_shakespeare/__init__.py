"""Example torch-handle plugin: the ``shakespeare`` dataset (character-level or BPE language modelling)."""

from pathlib import Path

SAMPLE = Path(__file__).with_name("sample.txt")
"""12 of Shakespeare's sonnets (public domain): what ``path = ""`` trains on."""

"""Checkpoints: the store (atomic step directories, manifests), the portable form, resume rules, and directories shared across nodes."""

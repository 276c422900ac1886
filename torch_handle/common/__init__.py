"""Small helpers every layer may use: terminal-safe text and formatting, units, atomic file writes. No torch."""

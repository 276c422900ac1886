"""Presets: the typed tables (schema), and loading, layering, overriding and dumping them (loader)."""

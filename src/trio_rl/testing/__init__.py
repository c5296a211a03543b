"""testing layer."""

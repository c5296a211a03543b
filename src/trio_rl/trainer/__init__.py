"""trainer layer."""

"""rollout layer."""

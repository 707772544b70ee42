"""rollout_client."""

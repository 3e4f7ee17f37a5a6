"""The emulated cluster: every method's throughput across shaped links, the two tiers, the scaling model."""

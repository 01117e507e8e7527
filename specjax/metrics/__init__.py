"""Every metric defined once: per-step statistics, the theory, the record
schema, and the one timing method."""

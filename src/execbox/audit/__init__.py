"""The audit log: one JSON record per decision and run, hash-chained, and its verification."""

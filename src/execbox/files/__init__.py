"""Files: workspace paths that never follow a link, bounded symlink-safe tar transfers, the size-limited
workspace."""

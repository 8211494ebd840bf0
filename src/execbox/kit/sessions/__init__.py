"""Sessions: the two shapes a backend's session takes - a local launcher over a host workspace, a remote
provider's sandbox."""

"""The contract between the runner and a backend: the request and result models, the backend and session ABCs,
output capture, result building and the plugin hooks."""

"""The core: models, settings, the backend contract, plugins, output capture, env policy, the runner."""

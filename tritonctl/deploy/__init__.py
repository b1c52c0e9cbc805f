"""Deployments: the runtime interface, the local and Compose runtimes, CPU shares, state, apply, the proxy."""

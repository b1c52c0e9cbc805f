"""Deployments: the runtime interface, the local and Compose runtimes, CPU shares, state, apply, the proxy."""

CONTROLLER_PORT = 9300  # the controller's state and metrics endpoint, unless told another

"""tritonctl: plan, render and apply dense NVIDIA Triton deployments."""

__version__ = "0.1.0"

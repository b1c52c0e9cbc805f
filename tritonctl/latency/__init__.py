"""The interference-aware latency model of InSS section 4, and Gpulet's for comparison."""

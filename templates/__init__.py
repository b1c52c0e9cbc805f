"""Files rendered into deployments: the Python-backend glue that runs an ONNX model on the CPU."""

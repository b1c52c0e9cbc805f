"""Files rendered into deployments: the Python-backend glue that runs a model, with onnxruntime on a CPU
(python_onnx_model.py) or on a GPU with PyTorch CUDA graphs or onnxruntime-gpu (python_torch_gpu_model.py)."""

"""Triton Python-backend glue that serves a model on the GPU (rendered by tritonctl for KIND_GPU instances).

Used where Triton has no GPU onnxruntime or TensorRT backend (the build in the nvidia-pytriton wheel has only
the Python backend). Two engines, in this order:

- `torchvision_source` set and PyTorch sees a GPU: the torchvision architecture built with the seeded random
  weights `tritonctl export` uses, fp32 weights with TF32 math, one CUDA graph captured per batch size up to
  max_batch_size at load (a batch runs the graph of its size: no padding, no launch overhead per layer);
- else onnxruntime with its CUDA execution provider (onnxruntime-gpu) over the rendered model.onnx.

Neither available: the model fails to load with a message saying what to install. Self-contained (it runs in
Triton's backend stub, whose Python has no tritonctl), so the capture repeats `profiler/gpu.py`'s. The process
runs on the GPU and MPS share its environment gives (CUDA_VISIBLE_DEVICES, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

SEED = 0  # tritonctl.export.SEED: the same weights as the exported ONNX file
WARMUP_RUNS = 3  # forward passes before a graph is captured (cuDNN picks its kernels)


class TorchGraphs:
    """A torchvision model on the GPU, one captured CUDA graph per batch size 1..max_batch."""

    def __init__(self, source: str, input_shape: list[int], max_batch: int):
        import torch
        import torchvision

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        self.torch = torch
        torch.manual_seed(SEED)
        module = torchvision.models.get_model(source, weights=None).eval().cuda()
        self.module = module  # the graphs read its weights: they must outlive the capture
        pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: they share one memory pool
        self.graphs = {}
        with torch.inference_mode():
            for batch in range(1, max_batch + 1):
                static_in = torch.zeros((batch, *input_shape), device="cuda")
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        module(static_in)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    static_out = module(static_in)
                self.graphs[batch] = (graph, static_in, static_out)

    def run(self, batch: np.ndarray) -> list[np.ndarray]:
        torch = self.torch
        graph, static_in, static_out = self.graphs[len(batch)]
        with torch.inference_mode():
            static_in.copy_(torch.from_numpy(batch))
            graph.replay()
            return [static_out.cpu().numpy()]


class OrtCuda:
    """onnxruntime's CUDA execution provider over model.onnx."""

    def __init__(self, path: str, input_name: str, output_names: list[str]):
        import onnxruntime as ort

        self.session = ort.InferenceSession(path, providers=["CUDAExecutionProvider"])
        self.input_name, self.output_names = input_name, output_names

    def run(self, batch: np.ndarray) -> list[np.ndarray]:
        return self.session.run(self.output_names, {self.input_name: batch})


def _engine(config: dict, onnx_path: str):
    source = config.get("parameters", {}).get("torchvision_source", {}).get("string_value")
    input_name = config["input"][0]["name"]
    output_names = [o["name"] for o in config["output"]]
    torch_error = None
    if source:
        try:
            import torch

            if torch.cuda.is_available():
                shape = [int(d) for d in config["input"][0]["dims"]]
                return TorchGraphs(source, shape, int(config["max_batch_size"]))
            torch_error = "PyTorch sees no GPU"
        except ImportError as exc:
            torch_error = f"cannot import {exc.name}"
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            return OrtCuda(onnx_path, input_name, output_names)
        ort_error = "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    except ImportError:
        ort_error = "onnxruntime is not installed"
    torch_part = f"PyTorch with torchvision ({torch_error})" if source else "no torchvision source to build"
    raise pb_utils.TritonModelException(f"no GPU engine for {config['name']}: {torch_part}; {ort_error}")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        onnx_path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.engine = _engine(config, onnx_path)
        self.input_name = config["input"][0]["name"]
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        results = self.engine.run(np.concatenate(arrays))
        bounds = np.cumsum([len(a) for a in arrays])[:-1]
        pieces = [np.split(result, bounds) for result in results]
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(n, p[k]) for n, p in zip(self.output_names, pieces, strict=True)]
            )
            for k in range(len(arrays))
        ]

"""Triton Python-backend glue that serves an ONNX model with onnxruntime (rendered by tritonctl).

Used where Triton has no onnxruntime backend (the CPU build in the nvidia-pytriton wheel).
Triton's dynamic batcher hands `execute` several requests at once; they are concatenated
into one onnxruntime run and the output is split back per request.

onnxruntime's intra-op threads do not spin while waiting for work: spinning threads of
instances sharing a CPU burn what the others need (measured: half the stubs' CPU time at the
CPU demo load, `python bench/ort_spinning.py`). TRITONCTL_ORT_SPINNING=1 in tritonserver's
environment turns it back on, for that comparison.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        threads = int(config["parameters"]["intra_op_threads"]["string_value"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        spinning = "1" if os.environ.get("TRITONCTL_ORT_SPINNING", "0") == "1" else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.input_name = config["input"][0]["name"]
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        results = self.session.run(self.output_names, {self.input_name: np.concatenate(arrays)})
        bounds = np.cumsum([len(a) for a in arrays])[:-1]
        pieces = [np.split(result, bounds) for result in results]
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(name, piece[i]) for name, piece in zip(self.output_names, pieces, strict=True)
                ]
            )
            for i in range(len(requests))
        ]

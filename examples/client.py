"""A plain Triton client for a tritonctl deployment: nothing tritonctl-specific is needed.

    python examples/client.py 127.0.0.1:8100 mobilenet_v2 [--requests 20]

`tritonctl endpoints PLAN` prints each model's address. The model's input name, shape
and type come from Triton's own metadata endpoint.
"""

import argparse
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

NUMPY = {"FP32": np.float32, "FP16": np.float16, "INT64": np.int64, "INT32": np.int32, "UINT8": np.uint8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="host:port of the model's gRPC endpoint")
    parser.add_argument("model", help="model name")
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    try:
        run(args)
    except InferenceServerException as exc:  # a closed port, a wrong model: one line, not a traceback
        sys.exit(f"error: {args.url}, model {args.model}: {' '.join(str(exc.message()).split())}")


def run(args: argparse.Namespace) -> None:
    client = grpcclient.InferenceServerClient(args.url)
    meta = client.get_model_metadata(args.model, as_json=True)
    spec, output = meta["inputs"][0], meta["outputs"][0]["name"]
    shape = [1] + [int(d) if int(d) > 0 else 1 for d in spec["shape"][1:]]
    data = np.random.default_rng(0).random(shape).astype(NUMPY[spec["datatype"]])
    request = grpcclient.InferInput(spec["name"], shape, spec["datatype"])
    request.set_data_from_numpy(data)

    latencies = []
    for _ in range(args.requests):
        started = time.perf_counter()
        result = client.infer(args.model, [request]).as_numpy(output)
        latencies.append(1000 * (time.perf_counter() - started))
    top5 = np.argsort(result[0])[::-1][:5]
    print(
        f"{args.model} at {args.url}: output {result.shape}, top-5 classes {top5.tolist()} "
        f"(random weights), median latency {np.median(latencies):.1f} ms over {args.requests} requests"
    )


if __name__ == "__main__":
    main()

"""Triton Python-backend glue that serves an ONNX model with onnxruntime (rendered by tritonctl).

Used where Triton has no onnxruntime backend (the CPU build in the nvidia-pytriton wheel).
Triton's dynamic batcher hands `execute` several requests at once; they are concatenated
into one onnxruntime run and the output is split back per request.

onnxruntime's intra-op threads do not spin while waiting for work: spinning threads of
instances sharing a CPU burn what the others need (measured: half the stubs' CPU time at the
CPU demo load, `python bench/ort_spinning.py`). TRITONCTL_ORT_SPINNING=1 in tritonserver's
environment turns it back on, for that comparison.

With the `reject_late_slo_ms` parameter (`runtime.reject_late`), an overloaded instance refuses a
request that can no longer meet its SLO when its batch starts, before it costs any compute: one that
arrived at the proxy (the `tritonctl-arrival-ms` parameter HAProxy stamps and tritonserver forwards)
so long ago that the run it would join ends past arrival + SLO even at the fastest of this
instance's recent runs: what can only be late. Overloaded: of the requests of the last RECENT_S
seconds, at least OVERLOADED_SHARE could only be late (refused or not), and at least OVERLOADED_MIN
of them. Late requests come in clusters (a stall of 80 ms leaves five of a 62/s model's requests
late at once), so a share of a short run of requests mistakes one stall for overload; over
seconds, an instance within its SLOs (99% of requests in time) mostly stays under 5%. Below
capacity a stall's late requests are served late, not refused, and a client (perf_analyzer among
them) sees no error. With `reject_late_always` (`runtime.reject_late: always`) every such request
is refused, overloaded or not.
"""

import json
import os
import time
from collections import deque

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

STALE_S = 1.0  # runs that ended longer ago than this are not trusted to refuse a request
RECENT_RUNS = 16  # how many runs' time per item the fastest is taken of
RECENT_S = 10.0  # the requests of this many seconds judge whether the instance is overloaded
OVERLOADED_SHARE, OVERLOADED_MIN = 0.05, 10  # overloaded: this share of them could only be late, and this many


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
        slo = config["parameters"].get("reject_late_slo_ms")
        self.slo_ms = float(slo["string_value"]) if slo else None
        self.always = config["parameters"].get("reject_late_always", {}).get("string_value") == "1"
        self.hopeless = deque()  # per request of the last RECENT_S: (when it came to a batch, could only be late)
        self.late_ones = 0  # how many of `hopeless` could only be late
        self.item_ms = deque(maxlen=RECENT_RUNS)  # the recent runs' time per item (the warm-up runs seed it)
        self.ran_at = 0.0  # when the last run ended (time.time())

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        late = self.late(requests, arrays)
        kept = [a for a, refuse in zip(arrays, late, strict=True) if not refuse]
        pieces = self.run(kept) if kept else []
        responses, k = [], 0
        for refuse in late:
            if refuse:
                responses.append(pb_utils.InferenceResponse(error=refuse))
            else:
                outputs = [
                    pb_utils.Tensor(name, piece[k]) for name, piece in zip(self.output_names, pieces, strict=True)
                ]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
                k += 1
        return responses

    def run(self, arrays):
        """One onnxruntime run over the arrays; per output, its piece for each array."""
        start = time.perf_counter()
        results = self.session.run(self.output_names, {self.input_name: np.concatenate(arrays)})
        items = sum(len(a) for a in arrays)
        per_item = 1000 * (time.perf_counter() - start) / items
        self.item_ms.append(per_item)
        self.ran_at = time.time()
        bounds = np.cumsum([len(a) for a in arrays])[:-1]
        return [np.split(result, bounds) for result in results]

    def late(self, requests, arrays):
        """Per request, the error refusing it, or None: with an SLO to keep and the instance overloaded (or
        refusing always), a request stamped on arrival whose run (this batch's items at the fastest recent time
        per item) would end past its arrival + SLO. Nothing is refused where nothing has run for STALE_S (the
        times are stale): the run measures again, so an instance too slow for its SLO answers about one batch a
        second, late, and refuses the rest."""
        if self.slo_ms is None or not self.item_ms:
            return [None] * len(requests)
        now_ms = 1000 * time.time()
        if now_ms - 1000 * self.ran_at > 1000 * STALE_S:
            return [None] * len(requests)
        ends_ms = now_ms + min(self.item_ms) * sum(len(a) for a in arrays)
        stamps = [json.loads(r.parameters() or "{}").get("tritonctl-arrival-ms") for r in requests]
        arrivals = [None if stamp is None else float(stamp) for stamp in stamps]
        hopeless = [a is not None and a + self.slo_ms < ends_ms for a in arrivals]
        self.hopeless.extend((now_ms, late) for late in hopeless)
        self.late_ones += sum(hopeless)
        while self.hopeless[0][0] < now_ms - 1000 * RECENT_S:
            self.late_ones -= self.hopeless.popleft()[1]
        if not self.always and self.late_ones < max(OVERLOADED_MIN, OVERLOADED_SHARE * len(self.hopeless)):
            return [None] * len(requests)
        return [
            pb_utils.TritonError(
                f"refused: waited {now_ms - arrived:.0f} ms, would answer after {ends_ms - arrived:.0f} ms, "
                f"past the SLO of {self.slo_ms:g} ms (runtime.reject_late)",
                pb_utils.TritonError.UNAVAILABLE,
            )
            if late
            else None
            for arrived, late in zip(arrivals, hopeless, strict=True)
        ]

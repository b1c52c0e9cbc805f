"""`tritonctl profile`: measure every model of a cluster, solo and co-located, into a dataset.

Solo configurations slower than the model's SLO allows any plan to use are not measured (grid.py).
Resumable (rows already in the dataset are skipped), bounded by an optional time budget,
with a progress bar. Nothing else should run on the machine meanwhile: co-runners that
tritonctl does not know about show up as noise.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from tritonctl.deploy import share
from tritonctl.deploy.local import LocalRuntime
from tritonctl.deploy.runtime import StartError
from tritonctl.errors import TritonctlError
from tritonctl.export import Artifact, materialize
from tritonctl.latency.dataset import Dataset, Measurement, ModelFeatures, load_dataset
from tritonctl.latency.device import cpu_fingerprint, software_versions
from tritonctl.planning.plan import PlannedModel, Tensor
from tritonctl.planning.planner import devices_of
from tritonctl.shares import CFS_PERIOD_US, threads_for
from tritonctl.spec import Cluster
from tritonctl.triton.binary import find_tritonserver
from tritonctl.triton.render import ort_spinning

from .graphinfo import graph_info
from .grid import (
    HELDOUT_BATCHES,
    SLOWER_THAN_SLO,
    TRAIN_BATCHES,
    Member,
    Run,
    coloc_runs,
    colocated,
    in_waves,
    left_out,
    repeat_runs,
    solo_runs,
)
from .harness import Harness

# Wake-up: per model, single requests after each idle gap (ms), WAKE_REQUESTS of them per gap.
WAKE_GAPS_MS = (0, 5, 10, 20, 30, 50, 100, 200)
WAKE_REQUESTS = 20
# Request cost: per model, batch-1 requests through HAProxy, after exponential idle gaps of this mean (a profile's
# and a calibration's alike: it is a CPU's own, not carried over).
COST_REQUESTS, COST_GAP_MS = 200, 5.0


def _tensors(sigs) -> list[Tensor]:
    return [Tensor(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in sigs]


def planned_for_profile(name: str, artifact: Artifact, source: str | None = None) -> PlannedModel:
    """The plan entry the renderer needs to serve `artifact` (SLO, rate and port are unused here); `source`: the
    torchvision architecture the GPU glue builds, where the model has one."""
    return PlannedModel(
        name=name,
        source=source,
        onnx=str(artifact.path),
        onnx_sha256=artifact.sha256,
        inputs=_tensors(artifact.inputs),
        outputs=_tensors(artifact.outputs),
        memory_mb=1,
        slo_ms=1,
        rate=0,
        port=65535,  # the harness gives each instance a free port
        placements=[{"instance": f"{name}-profile", "device": "x", "share": 1, "batch": 1}],
    )


def _open_dataset(folder: Path, cluster: Cluster, features: list[ModelFeatures], device: dict) -> Dataset:
    """A new dataset, or the existing one to resume when it was measured here for the same models."""
    if not (folder / "metadata.json").exists():
        return Dataset.create(
            folder,
            {
                "cluster": cluster.spec.name,
                "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "device": device,
                "share_mechanism": f"{share.mechanism()} CFS quota, period {CFS_PERIOD_US} us",
                "complete": False,
                "duration_s": 0.0,
                "ort_spinning": ort_spinning(),
            },
            features,
        )
    dataset = load_dataset(folder)
    recorded = dataset.metadata.get("ort_spinning")  # older profiles did not record it
    if recorded is not None and recorded != ort_spinning():
        raise TritonctlError(
            f"this profile was measured with onnxruntime threads {'spinning' if recorded == '1' else 'not spinning'}"
            f" and TRITONCTL_ORT_SPINNING={ort_spinning()} now: use a new --output folder",
            file=folder / "metadata.json",
            field="ort_spinning",
        )
    theirs = dataset.metadata.get("device", {})
    if theirs.get("id") != device["id"]:
        raise TritonctlError(
            f"this profile was measured on another device ({theirs.get('model')}, id {theirs.get('id')}; "
            f"this one is {device['model']}, id {device['id']}): use a new --output folder",
            file=folder / "metadata.json",
            field="device",
        )
    if set(dataset.models) != {f.model for f in features}:
        raise TritonctlError(
            f"this profile measured models {sorted(dataset.models)}, the cluster has "
            f"{sorted(f.model for f in features)}: use a new --output folder",
            file=folder / "models.csv",
        )
    for f in features:
        old = dataset.models[f.model]
        if old.onnx_sha256 != f.onnx_sha256:
            raise TritonctlError(
                f"model {f.model!r} changed since this profile began (its ONNX file differs): "
                "use a new --output folder",
                file=folder / "models.csv",
            )
    return dataset


def profile(
    cluster: Cluster, folder: Path, budget_s: float | None = None, log: Callable[[str], None] = print
) -> Dataset:
    """Measure the cluster's models into `folder`; returns the dataset (complete or not)."""
    if cluster.kind != "cpu":
        raise TritonctlError(
            "`tritonctl profile` measures cpu clusters through Triton; a gpu cluster is profiled on its GPU host "
            "with `python3 -m profiler.gpu measure`, then `python -m profiler.gpu assemble` here "
            "(docs/deploy-gpu-compose.md, 'Profile a GPU')",
            file=cluster.path,
            field="devices",
        )
    if share.mechanism() == "none":
        raise TritonctlError("profiling needs enforceable shares, and no cgroup is writable here (run as root)")
    device = devices_of(cluster)[0]
    if device.cores > (here := len(os.sched_getaffinity(0))):  # its shares would be quotas of CPU not there
        raise TritonctlError(
            f"the device profiled stands for {device.cores:g} cores and this host gives tritonctl {here}: set "
            "devices[0].cores to what this host has",
            file=cluster.path,
            field="devices[0].cores",
        )
    artifacts = materialize(cluster, log=log)
    features = [ModelFeatures(name, a.sha256, **graph_info(a.path).__dict__) for name, a in artifacts.items()]
    dataset = _open_dataset(folder, cluster, features, cpu_fingerprint())
    measured = {(r.units, r.cores) for r in dataset.rows}
    if measured - {(device.units, device.cores)}:
        raise TritonctlError(
            f"this profile was measured with other device settings (units, cores) {sorted(measured)}: "
            "use a new --output folder",
            file=cluster.path,
            field="devices[0]",
        )
    names = list(artifacts)
    runs = in_waves(solo_runs(names, device.units) + coloc_runs(names, device.units))
    runs += repeat_runs(names, device.units)  # last: as far from the first measurements as the profile allows
    measured_colocated = colocated(runs)
    limits = {m.name: SLOWER_THAN_SLO * m.slo_ms for m in cluster.spec.models}
    dataset.metadata["slower_than_ms"] = limits  # the fit takes the configurations beyond it as floors
    slow = [
        Member(r.model, r.share, r.batch)
        for r in dataset.rows
        if r.kind == "solo" and r.split == "train" and r.p50_ms > limits[r.model]
    ]
    pending = [run for run in runs if (run.group, run.members[0].model) not in dataset.done]
    log(
        f"profiling {len(names)} models on {device.id} ({device.cores:g} cores): {len(runs)} runs at most, "
        f"{len(runs) - len(pending)} already measured; a model's larger batches at no more share are skipped once "
        f"a batch takes over {SLOWER_THAN_SLO:g}x its SLO"
    )
    harness = Harness(
        LocalRuntime(find_tritonserver(cluster.spec.runtime.tritonserver), folder / "work"),
        device,
        {name: (planned_for_profile(name, a), a.path) for name, a in artifacts.items()},
        folder / "work",
        sorted(set(TRAIN_BATCHES) | set(HELDOUT_BATCHES)),
    )
    started = time.monotonic()
    try:
        with tqdm(pending, unit="run", dynamic_ncols=True, mininterval=1.0) as bar:
            for run in bar:
                if budget_s is not None and time.monotonic() - started > budget_s:
                    log(f"budget of {budget_s:g} s reached; run the same command again to resume")
                    break
                if left_out(run, slow, measured_colocated):
                    continue
                bar.set_description(_describe(run))
                try:
                    stats = harness.measure(run.members)
                except StartError as exc:
                    raise TritonctlError(f"profiling stopped: {exc}") from None
                rows = [_row(run, member, st, device) for member, st in zip(run.members, stats, strict=True)]
                dataset.append(rows, harness.memory)
                harness.memory = []
                if run.kind == "solo" and run.split == "train" and rows[0].p50_ms > limits[rows[0].model]:
                    slow.append(run.members[0])
        woken, costed = {w.model for w in dataset.wake}, {c.model for c in dataset.requests}
        for name in names:
            if budget_s is not None and time.monotonic() - started > budget_s:
                break
            try:
                if name not in woken:
                    gaps = ", ".join(map(str, WAKE_GAPS_MS))
                    log(f"wake-up of {name}: single requests after idle gaps of {gaps} ms")
                    _append_extra(dataset, harness, wake=harness.wake(name, WAKE_GAPS_MS, WAKE_REQUESTS))
                if name not in costed:
                    log(f"CPU a request of {name} costs: {COST_REQUESTS} batch-1 requests through HAProxy")
                    cost = harness.request_cost(name, COST_REQUESTS, COST_GAP_MS)
                    _append_extra(dataset, harness, requests=[cost])
            except StartError as exc:
                raise TritonctlError(f"profiling stopped: {exc}") from None
    finally:
        harness.close()
        dataset.metadata["duration_s"] = round(dataset.metadata["duration_s"] + time.monotonic() - started, 1)
        unused = {(r.group, r.members[0].model) for r in runs if left_out(r, slow, measured_colocated)}
        grid_done = {(r.group, r.members[0].model) for r in runs} - unused <= dataset.done
        extras = {w.model for w in dataset.wake} & {c.model for c in dataset.requests}
        dataset.metadata["complete"] = grid_done and set(names) <= extras
        if harness.server_version:
            dataset.metadata["software"] = software_versions(harness.server_version)
        dataset.metadata["grid"] = {"runs": len(runs), "beyond_slo": len(unused)}
        dataset.write_metadata()
    return dataset


def _append_extra(dataset: Dataset, harness: Harness, **measured) -> None:
    """Append a per-model measurement (wake-up points, request cost) and the footprints of any instance it
    started (a resumed run warms its instances up again: footprints already known are left out)."""
    known = {(m.model, m.threads, m.batch) for m in dataset.memory}
    dataset.append([], [m for m in harness.memory if (m.model, m.threads, m.batch) not in known], **measured)
    harness.memory = []


def _describe(run: Run) -> str:
    body = " + ".join(f"{m.model} b{m.batch} s{m.share}" for m in run.members)
    return f"{run.kind} {body}"[:60]


def _row(run: Run, member, st, device) -> Measurement:
    others = [m for m in run.members if m is not member]
    return Measurement(
        config_id=run.group,
        kind=run.kind,
        split=run.split,
        model=member.model,
        batch=member.batch,
        share=member.share,
        units=device.units,
        cores=device.cores,
        threads=threads_for(device, member.share),
        corunners=";".join(f"{m.model}:{m.share}:{m.batch}" for m in others),
        n_colocated=len(run.members),
        reps=st.reps,
        p50_ms=st.p50_ms,
        p95_ms=st.p95_ms,
        p99_ms=st.p99_ms,
        mean_ms=st.mean_ms,
        compute_ms=st.compute_ms,
        queue_ms=st.queue_ms,
        rss_mb=st.rss_mb,
        cpu_util=st.cpu_util,
    )

"""Verbs that measure models and fit their latency and energy: export, profile, fit, fit-energy, report, calibrate."""

from __future__ import annotations

from pathlib import Path

from tritonctl.cli.output import say
from tritonctl.errors import TritonctlError
from tritonctl.export import materialize
from tritonctl.files import not_an_input
from tritonctl.latency import energy
from tritonctl.latency.dataset import load_dataset
from tritonctl.latency.device import cpu_fingerprint
from tritonctl.latency.fit import fit_latency_model
from tritonctl.latency.mlp import HIDDEN, fit_mlp
from tritonctl.latency.model import load_latency_model
from tritonctl.latency.report import write_report
from tritonctl.profiler.calibrate import ROUNDS, calibrate, median_abs, round_spread
from tritonctl.profiler.run import profile
from tritonctl.spec import load_cluster


def cmd_export(args) -> int:
    cluster = load_cluster(args.cluster)
    say(f"exporting models of {cluster.spec.name}:")
    for name, artifact in materialize(cluster, log=say).items():
        say(f"  {name}: {artifact.weights_mb:.1f} MB of weights, sha256 {artifact.sha256[:12]}")
    return 0


def _calibrated_path(source: Path, folder: Path, fingerprint: dict | None = None) -> Path:
    """Where `source` calibrated to a device goes in `folder`: named after its fingerprint (by default this CPU's)."""
    return folder / f"{source.stem}.{(fingerprint or cpu_fingerprint())['id']}.json"


def _calibrate(cluster_arg: str, source: Path, output: Path | None) -> Path:
    """Calibrate `source` to this device for the cluster's models, write it to `output` (by default beside it,
    named after this device) and print its errors."""
    cluster = load_cluster(cluster_arg)
    if output is not None:
        not_an_input(output, [("the cluster file", cluster.path), ("the latency model to calibrate", source)])
    model = load_latency_model(source)
    if model.mlp is not None:
        say("note: the MLP predictor is the other device's and is not carried over: the calibrated model predicts "
            "by the InSS formula (profile here and fit --predictor mlp for an MLP of this device)")  # fmt: skip
    calibrated, points = calibrate(cluster, model, source, log=say)
    output = output or _calibrated_path(source, source.parent, calibrated.device.fingerprint)
    calibrated.save(output)
    checks = [p for p in points if not p.fitted]
    factors = calibrated.meta["calibrated"]["factors"]
    added = calibrated.meta["calibrated"].get("added_ms")
    if added:
        say("running time + " + ", ".join(f"{name} {c0:.2f} + {c1:.3f} * batch ms" for name, (c0, c1) in added.items()))
    else:
        say("running time x " + ", ".join(
            f"{name} {k:.2f} * batch^{g:.2f} * share^{d:.2f}" for name, (k, g, d) in factors.items()))  # fmt: skip
    say(
        f"held-out points ({len(checks)}): median |error| {100 * median_abs([p.error_before for p in checks]):.1f}% "
        f"before, {100 * median_abs([p.error_after for p in checks]):.1f}% after; worst after "
        f"{100 * max(abs(p.error_after) for p in checks):.1f}%"
    )
    typical, widest = round_spread(points)
    say(
        f"the same point in its {ROUNDS[cluster.kind]} rounds: {100 * typical:.1f}% apart (median), "
        f"{100 * widest:.1f}% at most: this machine's own noise, a floor under those errors"
    )
    say(f"calibrated latency model written to {output} ({calibrated.meta['calibrated']['seconds']:.0f} s)")
    return output


def cmd_calibrate(args) -> int:
    source = Path(args.latency_model)
    _calibrate(args.cluster, source, Path(args.output) if args.output else None)
    return 0


def cmd_profile(args) -> int:
    cluster = load_cluster(args.cluster)
    out = Path(args.output) if args.output else cluster.path.parent / "profile"
    dataset = profile(cluster, out, args.budget, log=say)
    state = "complete" if dataset.metadata["complete"] else "incomplete (run again to resume)"
    unused = dataset.metadata["grid"].get("beyond_slo", 0)
    say(
        f"profile {state}: {len(dataset.rows)} measurements in {out} ({dataset.metadata['duration_s']:.0f} s); "
        f"{unused} solo configurations not measured: slower than any plan can use"
    )
    return 0


def cmd_fit(args) -> int:
    dataset = load_dataset(args.profile)
    out = Path(args.output) if args.output else dataset.folder / "latency-model.json"
    data = [p for p in dataset.folder.iterdir() if p.suffix == ".csv" or p.name == "metadata.json"]
    not_an_input(out, [(f"the profile's {p.name}", p) for p in data])
    say(f"fitting {dataset.folder} ({len(dataset.rows)} measurements):")
    model = fit_latency_model(dataset, log=say)
    if args.predictor == "mlp":
        model.mlp = fit_mlp(dataset, model.eff)
        say(
            f"  MLP predictor: {len(model.mlp.names)} models, {len(model.mlp.networks)} networks of hidden layers "
            f"{HIDDEN}, L2 penalty {model.mlp.penalty:g} (cross-validated on the training rows)"
        )
    model.save(out)
    say(f"latency model written to {out}")
    if args.report:
        _report(dataset, out, out.parent / "report")
    return 0


def cmd_fit_energy(args) -> int:
    sweep = Path(args.sweep)
    not_an_input(Path(args.output), [("the sweep", sweep)])
    samples = energy.read_samples(sweep)
    say(f"fitting {sweep} ({len(samples)} measurements; EAIS: over the clock per batch size, then over the batch) ...")
    try:
        model = energy.fit(samples, meta={"sweep": str(sweep)})
    except TritonctlError as exc:  # the sweep's shape: say which file
        raise TritonctlError(exc.message, file=sweep) from None
    energy.save(model, Path(args.output))
    say(f"energy model written to {args.output}: clocks {model.clocks[0]}-{model.clocks[-1]} MHz, batch 1-32")
    for name, err in model.errors.items():
        if err:
            say(
                f"  {name:18} leaving a clock out: time median {err['time_median_pct']}% / p95 {err['time_p95_pct']}%, "
                f"energy median {err['energy_median_pct']}% / p95 {err['energy_p95_pct']}%"
            )
    if args.plot:
        energy.plot(model, samples, Path(args.plot))
        say(f"figure written to {args.plot}")
    return 0


def _report(dataset, model_path: Path, out: Path) -> None:
    say("evaluating on held-out measurements beside a linear and an MLP predictor fitted for the comparison "
        "(a minute or two on 2 cores) ...")  # fmt: skip
    figures = write_report(load_latency_model(model_path), dataset, out)
    say(f"report written to {out / 'report.md'}")
    say(
        f"  held-out solo:       InSS-style {figures['solo_inss']}\n"
        f"                       linear     {figures['solo_linear']}\n"
        f"                       MLP        {figures['solo_mlp']}"
    )
    say(
        f"  held-out co-located: InSS-style {figures['coloc_inss']}\n"
        f"                       Gpulet     {figures['coloc_gpulet']}\n"
        f"                       linear     {figures['coloc_linear']}\n"
        f"                       MLP        {figures['coloc_mlp']}"
    )
    repeat = figures["repeat"]
    say(
        "  measured again:      "
        + (f"held-out configurations moved by {repeat}: how far this machine repeats" if repeat != "n/a" else "none")
    )
    say(f"  cache proxy vs slowdown r = {figures['proxy_r']:.2f}; prediction {figures['cost_us']:.1f} us/query")


def cmd_report(args) -> int:
    dataset = load_dataset(args.profile)
    model_path = Path(args.model) if args.model else dataset.folder / "latency-model.json"
    _report(dataset, model_path, Path(args.output) if args.output else dataset.folder / "report")
    return 0

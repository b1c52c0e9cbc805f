"""The tritonctl command line: each stage of spec -> plan -> render -> apply runs on its own.

The parser is here; each verb group's handlers live in a module of their own (measure, planning,
deploy, demo), imported only when one of its verbs runs, so `--help` and light verbs start fast.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from tritonctl import __version__
from tritonctl.cli import output
from tritonctl.deploy import CONTROLLER_PORT
from tritonctl.errors import TritonctlError
from tritonctl.files import check_output_dir
from tritonctl.planning.policies import POLICIES

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
MAX_SIMULATED_S = 3600.0  # a simulation draws all its arrivals at once: its length bounds their memory
MAX_RATE_SCALE = 100.0
BATCHING = ("fill", "prompt", "eager")  # how a plan sizes its batches (`plan --batching`)

DEMO_CLUSTER = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo" / "cluster.yaml"  # in a checkout


def _output_file(text: str) -> str:
    """argparse type of an -o naming a file to write: not a folder, in a folder that can hold it."""
    if not text:
        raise argparse.ArgumentTypeError("empty: name the file to write")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: name the file to write")
    _output_folder(str(Path(text).parent))
    return text


def _figure_file(text: str) -> str:
    """argparse type of a figure to write (--plot): a file whose suffix names a format matplotlib writes."""
    if Path(text).suffix.lower() not in FIGURE_SUFFIXES:
        suffixes = ", ".join(FIGURE_SUFFIXES)
        raise argparse.ArgumentTypeError(f"{text}: name a {suffixes} file (the suffix picks the format)")
    return _output_file(text)


def _output_folder(text: str) -> str:
    """argparse type of an -o naming a folder to write into: a folder (or none yet) that tritonctl can write."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    try:
        check_output_dir(Path(text), file=None, field=None, writable=True)
    except TritonctlError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _number(text: str) -> float:
    """argparse type of a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _margin(text: str) -> float:
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1 (0.1 is 10%), not {text}")
    return value


def add_margin(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--latency-margin",
        type=_margin,
        default=0.0,
        metavar="M",
        help="plan as if every batch ran (1 + M) times as long as the latency model predicts: headroom for a "
        "model that is off by up to M (default 0; 0.1 for 10%%)",
    )


def _positive(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _non_negative(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _positive_up_to(most: float, beyond: str) -> Callable[[str], float]:
    """argparse type of a positive number up to `most`; `beyond` follows the text given where it is more."""

    def parse(text: str) -> float:
        value = _positive(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"{text}{beyond}")
        return value

    return parse


_rate_scale = _positive_up_to(MAX_RATE_SCALE, f": at most {MAX_RATE_SCALE:g} times the planned rates")
_simulated_seconds = _positive_up_to(MAX_SIMULATED_S, f" s: simulate at most {MAX_SIMULATED_S:g} s")


def _whole(text: str, least: int, most: int | None = None) -> int:
    """A whole number from `least` (to `most`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < least or (most is not None and value > most):
        bounds = f"from {least} to {most}" if most is not None else f"from {least}"
        raise argparse.ArgumentTypeError(f"{text}: a whole number {bounds}")
    return value


def _seed(text: str) -> int:
    return _whole(text, 0)


def _port(text: str) -> int:
    return _whole(text, 0, 65535)


def _count(text: str) -> int:
    return _whole(text, 1)


def _fraction(text: str) -> float:
    """argparse type of a share: above 0, at most 1."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1 (0.99 is 99%), not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tritonctl",
        description="Plan, render and apply dense NVIDIA Triton deployments. "
        "Typical flow: tritonctl plan cluster.yaml && tritonctl apply plan.yaml",
    )
    parser.add_argument("--version", action="version", version=f"tritonctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    def add_format(p):
        p.add_argument(
            "--format",
            choices=["text", "json"],
            default="text",
            help="text for people (default); json for programs: one JSON document on stdout, progress on stderr",
        )

    def add_compose_dir(p):
        p.add_argument(
            "--compose-dir",
            help="compose: the project folder (tritonctl render --target compose; default: compose/ beside the plan)",
        )
        p.add_argument("--namespace", default="tritonctl", help="kubernetes: the namespace (default: tritonctl)")

    def add_deployment(p):
        p.add_argument("plan", nargs="?", help="plan.yaml")
        p.add_argument(
            "--state-dir",
            help="instead of a plan: the deployment's state folder (its runtime.state_dir), where the plan file is "
            "gone or unreadable",
        )

    def add_runtime(p):
        p.add_argument(
            "--runtime",
            choices=["local", "compose", "kubernetes"],
            default="local",
            help="local (default): tritonserver processes here; compose: services of a rendered Compose project; "
            "kubernetes: Deployments through the Kubernetes API (kubeconfig or in-cluster)",
        )
        add_compose_dir(p)

    p = add("export", "measure.cmd_export", "export the cluster's torchvision models to ONNX (cached by content)")
    p.add_argument("cluster", help="cluster.yaml")
    p = add(
        "profile", "measure.cmd_profile", "measure the models over batch x share, solo and co-located, through Triton"
    )
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument(
        "-o",
        "--output",
        type=_output_folder,
        help="dataset folder (default: profile/ beside the cluster file); resumes if present",
    )
    p.add_argument(
        "--budget",
        type=_non_negative,
        help="stop after this many seconds (resume later; 0: write the metadata only; default: no limit)",
    )
    p = add(
        "plan",
        "planning.cmd_plan",
        "choose placements, shares and batch sizes and write a plan file (exports the cluster's models to ONNX "
        "first, cached by content)",
    )
    add_format(p)
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument(
        "-o", "--output", type=_output_file, help="plan file to write (default: plan.yaml beside the cluster file)"
    )
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        help="placement policy (see `tritonctl policies`); default: search with --latency-model (the best here), "
        "spread without one (the only policy that needs no latency model)",
    )
    p.add_argument(
        "--latency-model", help="a fitted latency model (tritonctl fit or calibrate): adds predictions to the plan"
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail if any model cannot be served or is predicted to miss its SLO (default: plan the others, list "
        "it; warn of misses)",
    )
    p.add_argument("--policy-file", help="inss: the trained policy (default: rl/policies/<cluster name>.pt)")
    p.add_argument(
        "--minimise",
        choices=["devices"],
        help="devices: plan on the fewest of the cluster's devices that serve every model within its SLO, and say "
        "which (needs --latency-model; fails, saying why, where not even all of them do)",
    )
    p.add_argument(
        "--objective",
        choices=["throughput", "energy"],
        default="throughput",
        help="throughput: the policy's plan (default); energy (GPU clusters, EAIS): then the SM clock and batch sizes "
        "that serve every model within its SLO with the fewest joules, the clock locked at apply "
        "(needs --latency-model and --energy-model)",
    )
    p.add_argument("--energy-model", help="energy: batch time and energy per image over batch x clock (fit-energy)")
    p.add_argument(
        "--batching",
        choices=BATCHING,
        help="fill: each instance serves the largest batch that meets its SLO (InSS's BDA), Triton's queue delay "
        "filling it: the most requests a share serves, each waiting up to the SLO's slack; prompt: the "
        "batch of least predicted p99 that still meets the SLO at 1.5x the rate: answers sooner, less headroom; "
        "eager: BDA's batch as the largest (on a GPU taken in turns, the largest its duty cycle keeps), no queue "
        "delay: batches grow with the load. Default: eager for a GPU cluster with a latency model (what answered "
        "sooner and carried more there, docs/gpu.md), fill otherwise. Needs --latency-model",
    )
    add_margin(p)
    p = add(
        "fit-energy",
        "measure.cmd_fit_energy",
        "fit EAIS's curves (time and energy per image over batch size x SM clock) to an energy sweep's CSV "
        "(python3 -m tritonctl.profiler.energy on the GPU host)",
    )
    p.add_argument("sweep", help="the sweep's CSV")
    p.add_argument("-o", "--output", required=True, type=_output_file, help="the energy model to write (.json)")
    p.add_argument(
        "--plot", type=_figure_file, help="also draw the measurements against the fitted curves (.png, .svg or .pdf)"
    )
    p = add(
        "calibrate",
        "measure.cmd_calibrate",
        "carry a latency model profiled on another device to this one: a short measurement through Triton (under a "
        "minute a model on 2 cores). CPU: running time x k * batch^gamma * share^delta per model; GPU (a profile of "
        "the models' CUDA graphs alone): running time + c0 + c1 * batch, what serving them through Triton adds. "
        "Prints its error on held-out points",
    )
    p.add_argument("cluster", help="cluster.yaml (its models must be in the latency model)")
    p.add_argument("--latency-model", required=True, help="the latency model to carry over (tritonctl fit)")
    p.add_argument(
        "-o",
        "--output",
        type=_output_file,
        help="where to write it (default: in the source model's folder, named after this device's id)",
    )
    p = add("fit", "measure.cmd_fit", "fit the interference-aware latency model (InSS section 4) to a profile")
    p.add_argument("profile", help="profile folder (tritonctl profile)")
    p.add_argument(
        "-o", "--output", type=_output_file, help="model file (default: latency-model.json in the profile folder)"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="also evaluate on held-out measurements (as `tritonctl report`), into report/ beside the latency model",
    )
    p.add_argument(
        "--predictor",
        choices=["inss", "mlp"],
        default="inss",
        help="inss: the interference-aware model (default); mlp: an Abacus-style MLP predicts each batch's latency "
        "from which models co-run, their batches and shares (the rest of the file, memory and wake-up, stays InSS's)",
    )
    p = add("report", "measure.cmd_report", "evaluate a fitted latency model on held-out measurements, with plots")
    p.add_argument("profile", help="profile folder")
    p.add_argument("--model", help="latency model file (default: latency-model.json in the profile folder)")
    p.add_argument("-o", "--output", type=_output_folder, help="report folder (default: report/ in the profile folder)")
    add("policies", "planning.cmd_policies", "list the placement policies")
    p = add(
        "bundle",
        "deploy.cmd_bundle",
        "write the trimmed Triton (tritonserver, Python backend, perf_analyzer and the libraries they link) as one "
        ".tar.xz for a host without the nvidia-pytriton wheel",
    )
    p.add_argument("-o", "--output", required=True, type=_output_file, help="the archive to write (.tar.xz)")
    p.add_argument(
        "--python",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the target host's Python version, whose backend stub goes in (default: this one's)",
    )
    p = add("render", "deploy.cmd_render", "render a plan into per-instance Triton model repositories")
    p.add_argument("plan", help="plan.yaml")
    p.add_argument(
        "--target",
        choices=["repositories", "compose", "kubernetes"],
        default="repositories",
        help="repositories (default): in the plan's repository_dir (local runtime); compose: a Docker Compose "
        "project; kubernetes: a kustomize folder (GPU plans, both)",
    )
    p.add_argument(
        "-o",
        "--output",
        type=_output_folder,
        help="compose, kubernetes: the folder (default: compose/ or kubernetes/ beside the plan)",
    )
    p.add_argument(
        "--node",
        help="kubernetes: the node the plan's GPUs are on (default: nodes labelled tritonctl.io/cluster=<cluster>)",
    )
    p.add_argument("--namespace", default="tritonctl", help="kubernetes: the namespace (default: tritonctl)")
    p.add_argument("--gpus", type=int, help="compose: GPUs on the target host (default: count them here, if any)")
    p.add_argument(
        "--latency-model",
        help="compose: the latency model the sidecar re-plans with as rates move (kept in .env as LATENCY_MODEL; "
        "without one the sidecar follows the plan file and never re-plans)",
    )
    p = add(
        "apply",
        "deploy.cmd_apply",
        "start or change Triton instances to match a plan (exit 2: bad input, nothing done; exit 3: the apply "
        "failed and was rolled back, the previous deployment keeps serving)",
    )
    p.add_argument("plan", help="plan.yaml")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the steps without doing them (compose: also every docker command and HTTP call); exit 1 "
        "when something would change, 0 when nothing would",
    )
    p.add_argument(
        "--accept-misses",
        action="store_true",
        help="apply a plan even where its own predictions or simulation miss an SLO, or it leaves a model unserved "
        "(refused otherwise)",
    )
    add_runtime(p)
    p = add("validate", "planning.cmd_validate", "check a cluster or plan file as every verb would, touching nothing")
    p.add_argument("file", help="cluster.yaml or plan.yaml")
    p = add("schema", "planning.cmd_schema", "print the JSON Schema of the cluster file (for editors and CI checks)")
    p.add_argument("--plan", action="store_true", help="the plan file's schema instead")
    p = add(
        "controller",
        "deploy.cmd_controller",
        "run the sidecar: apply the plan, watch rates, re-size batches (BDA) or re-plan (policy), apply",
    )
    p.add_argument("plan", help="plan.yaml to start from (or resume the plan the controller applied last)")
    p.add_argument("--latency-model", help="latency model (tritonctl fit or calibrate); without it, no re-planning")
    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        help="policy to re-plan with when BDA fails (default: inss where a trained policy for the cluster ships, "
        "trained on a latency model of the same device; search otherwise)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address of the state and metrics endpoint (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=_port,
        default=CONTROLLER_PORT,
        help=f"port of the state and metrics endpoint (default {CONTROLLER_PORT}; 0: any free)",
    )
    p.add_argument("--interval", type=_positive, default=1.0, help="seconds between metric scrapes (default 1)")
    p.add_argument("--threshold", type=_positive, default=0.25, help="relative rate change that acts (default 0.25)")
    p.add_argument(
        "--cooldown", type=_non_negative, default=10.0, help="seconds between two changes (default 10; 0: none)"
    )
    add_margin(p)
    add_runtime(p)
    p = add(
        "status",
        "deploy.cmd_status",
        "show the running instances, their shares, ports and health, and whether they are what the plan says "
        "(exit 1 when one is unhealthy)",
    )
    add_format(p)
    add_deployment(p)
    add_compose_dir(p)
    p = add("endpoints", "deploy.cmd_endpoints", "show where clients send requests for each model")
    add_format(p)
    p.add_argument("plan", help="plan.yaml")
    p = add("down", "deploy.cmd_down", "stop every instance of the deployment (through the runtime that applied it)")
    add_deployment(p)
    p.add_argument("--dry-run", action="store_true", help="print what would be stopped (compose: every command)")
    add_compose_dir(p)
    p = add("simulate", "planning.cmd_simulate", "replay Poisson traffic against a plan in a discrete-event simulator")
    add_format(p)
    p.add_argument("plan", help="plan.yaml")
    p.add_argument("--latency-model", required=True, help="fitted latency model (tritonctl fit)")
    p.add_argument(
        "--duration", type=_simulated_seconds, default=60.0, help="simulated seconds (default 60, at most 3600)"
    )
    p.add_argument(
        "--rate-scale", type=_rate_scale, default=1.0, help="multiply every model's rate (default 1, at most 100)"
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed of the arrival process (default 0)")
    p.add_argument("--drop", action="store_true", help="drop requests that can no longer meet their SLO")
    p.add_argument("--trace", help="replay this trace (CSV: model,time_s) instead of Poisson arrivals at the rates")
    p.add_argument(
        "--latency-error",
        type=_margin,
        default=0.0,
        metavar="X",
        help="run every model's batches (1 + e) times as long as predicted, e fixed per model, uniform in "
        "[-X, X] (seeded): a latency model that is off (default 0; at least 0, below 1: 0.1 is 10%%)",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="also write into the plan file the predictions and simulation of the plan as it is now (after a hand "
        "edit: apply then checks them again)",
    )
    p = add(
        "bench",
        "planning.cmd_bench",
        "plan a cluster with several policies and simulate each plan side by side, a request that can only be late "
        "dropped (exit 1: no policy planned)",
    )
    add_format(p)
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument("--latency-model", required=True, help="fitted latency model (tritonctl fit)")
    p.add_argument(
        "--policies", nargs="+", help="policies to compare (default: all; inss where a trained policy exists)"
    )
    p.add_argument(
        "--duration",
        type=_simulated_seconds,
        default=60.0,
        help="simulated seconds per policy (default 60, at most 3600)",
    )
    p.add_argument(
        "-o", "--output", type=_output_folder, help="output folder (default: bench/ beside the cluster file)"
    )
    p.add_argument(
        "--energy-model",
        help="GPU clusters: also each plan's joules per request by this energy model (fit-energy), and search's "
        "placement under the energy objective",
    )
    p.add_argument("--policy-file", help="inss: the trained policy (default: rl/policies/<cluster name>.pt)")
    add_margin(p)
    p.add_argument(
        "--batching",
        choices=BATCHING,
        default="fill",
        help="how every policy's plan sizes its batches, as `plan --batching` (default fill, on a GPU too, so that "
        "the policies compare on InSS's batching; the energy objective's row plans with fill)",
    )
    p.add_argument(
        "--ablate",
        action="store_true",
        help="instead of the policies: search planning with the latency model less one part at a time (no "
        "interference terms, no wake-up, linear instead of LWR, no queueing model), each plan simulated on the "
        "whole model",
    )
    p = add("train", "planning.cmd_train", "train the inss policy for a cluster (imitating search, or SAC-Discrete)")
    p.add_argument("cluster", help="cluster.yaml")
    p.add_argument("--latency-model", required=True, help="fitted latency model (tritonctl fit)")
    p.add_argument(
        "--method",
        choices=["imitate", "sac"],
        default="imitate",
        help="imitate: fit the actor to search's decisions over random rates (default); sac: SAC-Discrete, InSS "
        "Algorithm 2, from scratch or (--init) from an imitated actor",
    )
    p.add_argument(
        "--demonstrations", type=_count, help="imitate: workloads search decides for the actor to learn (default 1500)"
    )
    p.add_argument("--epochs", type=_count, help="imitate: passes over the demonstrations (default 200)")
    p.add_argument("--episodes", type=_count, help="sac: episodes in all, resumed ones included (default 400)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the network and the workloads (default 0)")
    p.add_argument("--resume", action="store_true", help="sac: go on from the run folder's last checkpoint")
    p.add_argument(
        "--init",
        metavar="POLICY",
        help="sac: start the actor from this trained policy (imitation's: fine-tuning), not from scratch",
    )
    p.add_argument(
        "-o",
        "--output",
        type=_output_folder,
        help="run folder: log, learning curve, demonstrations or checkpoint (default: rl/runs/<cluster>)",
    )
    p.add_argument("--policy-file", help="where the trained policy goes (default: rl/policies/<cluster name>.pt)")
    p = add("load", "deploy.cmd_load", "send Poisson traffic at the planned rates and print latency and throughput")
    add_format(p)
    p.add_argument("plan", help="plan.yaml")
    p.add_argument(
        "--tool",
        choices=["tritonctl", "perf_analyzer"],
        default="tritonctl",
        help="load generator: tritonctl's own client (default) or NVIDIA perf_analyzer, one process per model",
    )
    p.add_argument("--duration", type=_positive, default=10.0, help="seconds of traffic (default 10)")
    p.add_argument(
        "--rate-scale",
        type=_rate_scale,
        default=1.0,
        help="multiply every model's rate (default 1: the planned rates, where the plan's simulated p99 is printed "
        "beside the measured one; at most 100)",
    )
    p.add_argument(
        "--min-within-slo",
        type=_fraction,
        metavar="F",
        help="exit 1 when a model has fewer than this share of its requests answered within its SLO (0.99 is 99%%; "
        "default: only when a model had no answer), naming the models",
    )
    p = add(
        "demo",
        "demo.cmd_demo",
        "the CPU demo end to end: calibrate its latency model to this CPU where it was made on another (two to three "
        "minutes, once), plan, apply on a local Triton, load; the deployment keeps running (tritonctl down stops it)",
    )
    p.add_argument("cluster", nargs="?", default=str(DEMO_CLUSTER), help="cluster.yaml (default: the CPU demo)")
    p.add_argument(
        "--policy", default="search", choices=list(POLICIES), help="placement policy (default search, tritonctl's best)"
    )
    p.add_argument(
        "--latency-model",
        help="fitted latency model (default: the committed profiles/<cluster name>/latency-model.json)",
    )
    p.add_argument("--duration", type=_positive, default=10.0, help="seconds of traffic (default 10)")
    p.add_argument("--teardown", action="store_true", help="stop the deployment at the end")
    return parser


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through `finally`, so started instances are stopped


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output.JSON = getattr(args, "format", "text") == "json"
    module, _, name = args.func.rpartition(".")
    handler = getattr(importlib.import_module(f"tritonctl.cli.{module}"), name)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return handler(args)
    except TritonctlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        changing = name in ("cmd_apply", "cmd_down", "cmd_controller")  # a change cut short: what now
        which = args.plan or f"--state-dir {args.state_dir}"
        hint = f": `tritonctl status {which}` shows what runs; apply or down it again to finish" if changing else ""
        print(f"interrupted{hint}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

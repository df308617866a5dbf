"""The ``shardscope`` command line.

``shardscope`` alone opens the window on the embedded default (local CPU ranks).
Every user mistake ends with a message on stderr and a non-zero exit, never a traceback.

Exit codes: 0 success; 1 the job itself failed (a run that failed, a config that does not
fit, a Python for the ranks without torch: the message says what to install); 2 a user mistake
(bad arguments, invalid config, missing file).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A user mistake: printed as one message, exit code attached."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def _load(path: str):
    from engine import Config

    p = Path(path)
    if not p.exists():
        raise CliError(f"config file not found: {path}")
    return Config.load(p)


def _summary(cfg) -> str:
    m, c, par, t = cfg.model, cfg.cluster, cfg.parallel, cfg.training
    name = m.preset or "custom model"
    layout = f"dp={par.dp} tp={par.tp} pp={par.pp}"
    if par.cp > 1:
        layout += f" cp={par.cp} ({par.cp_rotate})"
    if par.ep > 1:
        layout += f" ep={par.ep}"
    layout += f" zero={par.zero}"
    if par.replicate > 1:
        layout += f" replicate={par.replicate}"
    if par.sequence_parallel:
        layout += " +sp"
    if par.pp > 1:
        layout += f" {par.schedule} v={par.virtual_stages} m={par.microbatches}"
    return (f"{name} ({m.layers} layers, hidden {m.hidden}) on {c.gpus} × {c.gpu.name} "
            f"({c.nodes} node(s)); {layout}; {t.precision}, {t.optimizer}, recompute {t.recompute}"
            + (f", float8 {t.float8}" if t.float8 != "none" else "") + (", compile" if t.compile else ""))


# --------------------------------------------------------------------------- commands


def cmd_validate(args: argparse.Namespace) -> int:
    from engine import ConfigError

    failed = 0
    for path in args.configs:
        try:
            cfg = _load(path)
        except ConfigError as exc:
            failed += 1
            print(f"{path}: {exc}", file=sys.stderr)
            continue
        print(f"{path}: valid — {_summary(cfg)}")
    return EXIT_USAGE if failed else EXIT_OK


def cmd_predict(args: argparse.Namespace) -> int:
    import json

    cfg = _load(args.config)  # a refused config costs no numpy import

    from engine.predict import predict
    from gui.text import prediction_table

    calibration = None
    if args.calibration:
        calibration = _calibration(args.calibration)
        pred = calibration.predict(cfg)
    else:
        pred = predict(cfg)
    if args.json:
        out = pred.to_json(explain=args.explain)
        if calibration is not None:
            out["calibration"] = calibration.to_json()
        if args.over_step:  # each rank's categories at their own worst moments, beside the snapshot
            peaks = {g.first.rank: g.first.category_peaks() for g in pred.memory.distinct_groups()}
            group_of = {r: g.first.rank for g in pred.memory.distinct_groups() for r in g.ranks}
            for entry in out["memory"]["per_rank"]:
                entry["over_step"] = peaks[group_of[entry["rank"]]]
        print(json.dumps(out, indent=2))
    else:
        print(_summary(cfg))
        if calibration is not None:
            c = calibration
            what = ("speed over the clock from ops" if c.config.conventions.clock == "ops"
                    else "compute efficiency")
            print(f"calibrated from {c.source}: {what} {c.compute_efficiency:.3g} "
                  f"(forward {c.forward_efficiency:.3g}, backward {c.backward_efficiency:.3g})"
                  + ("; same stages: measured per-stage durations" if c.same_stages(cfg) else ""))
        print(prediction_table(pred, explain=args.explain, over_step=args.over_step))
    return EXIT_OK


def _run_dir(path: str) -> Path:
    d = Path(path)
    if not d.exists():
        raise CliError(f"run directory not found: {path}")
    if not d.is_dir():
        raise CliError(f"not a run directory: {path}")
    if not (d / "config.toml").exists():
        raise CliError(f"{path} has no config.toml: not a run directory")
    if not (d / "measurement.json").exists():
        raise CliError(f"{path} has no measurement.json: the run failed or has not finished "
                       f"(see {d / 'events.jsonl'})")
    return d


def _calibration(path: str):
    from engine.compare.calibrate import CalibrationError, load_calibration

    d = _run_dir(path)
    try:
        return load_calibration(d)
    except CalibrationError as exc:
        raise CliError(f"cannot calibrate from {path}: {exc}") from None


def cmd_compare(args: argparse.Namespace) -> int:
    import json

    from engine.compare.measured import compare
    from engine.predict import predict
    from engine.time.ops import clock_description
    from gui.text import comparison_table

    d = _run_dir(args.run_dir)
    cfg = _load(str(d / "config.toml"))
    try:
        meas = json.loads((d / "measurement.json").read_text(encoding="utf-8"))
        cmp = compare(predict(cfg), meas)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CliError(f"{d / 'measurement.json'} is not a readable measurement ({exc})") from None
    recorded = _recorded_clock(d)
    if args.json:
        print(json.dumps({**cmp.to_json(), "recorded_clock": recorded}, indent=2))
    else:
        print(_summary(cfg))
        print(comparison_table(cmp))
        now = clock_description(cfg)
        if recorded and recorded.get("description") != now:
            print(f"note: timed now by the {now}; when it ran, by the {recorded.get('description')} "
                  "(its device-profile.json)")
    return EXIT_OK


def _recorded_clock(run_dir: Path) -> dict | None:
    """The run's ``device-profile.json`` (what timed its prediction on the machine it ran on), if readable."""
    import json

    try:
        doc = json.loads((run_dir / "device-profile.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args.config)  # validate before anything starts
    if args.steps < 1:
        raise CliError(f"--steps {args.steps}: must be at least 1")
    if not args.timeout > 0:
        raise CliError(f"--timeout {args.timeout:g}: must be more than 0 seconds")
    if args.target != "local" or args.dry_run:
        return _cmd_run_cluster(args, cfg)
    from backend.launch import run_cli

    return run_cli(args.config, out_dir=args.out, steps=args.steps, json_events=args.json,
                   timeout_s=args.timeout, fresh=args.fresh)


def _cmd_run_cluster(args: argparse.Namespace, cfg) -> int:
    """``run --target slurm|hosts``: backend.cluster builds the job, submits it and follows it."""
    from backend.cluster import ClusterError, cluster_run_cli, node_layout
    from backend.cluster import hosts as hosts_target
    from backend.cluster import slurm as slurm_target
    from backend.cluster.follow import config_for_layout
    from backend.launch import default_run_dir

    if args.target == "local":
        raise CliError("--dry-run needs --target slurm or --target hosts")
    if args.target == "hosts" and not args.hosts:
        raise CliError("--target hosts needs --hosts HOST1,HOST2,...")
    if args.target == "slurm" and args.hosts:
        raise CliError("--hosts is for --target hosts; Slurm chooses the nodes (use --nodes, --partition)")
    out = Path(args.out) if args.out else default_run_dir()
    try:
        if args.target == "hosts":
            hosts, port = hosts_target.parse_hosts(args.hosts)
            if args.nodes is not None and args.nodes != len(hosts):
                raise CliError(f"--nodes {args.nodes} but --hosts names {len(hosts)} host(s)")
            if args.dry_run:
                nodes, per_node = node_layout(cfg, len(hosts), args.gpus_per_node)
                for c in hosts_target.node_commands(config_for_layout(cfg, nodes, per_node), out, args.steps,
                                                    hosts, per_node, port):
                    print(f"# on {c['host']} (node {c['node']}):\n{c['shell']}")
                return EXIT_OK
            run = hosts_target.start(args.config, args.hosts, out, steps=args.steps, timeout_s=args.timeout,
                                     per_node=args.gpus_per_node, fresh=args.fresh)
        else:
            opts = dict(partition=args.partition, time_limit=args.time, account=args.account)
            if args.dry_run:
                nodes, per_node = node_layout(cfg, args.nodes, args.gpus_per_node)
                print(slurm_target.sbatch_script(config_for_layout(cfg, nodes, per_node), out, args.steps,
                                                 nodes=nodes, per_node=per_node, **opts), end="")
                return EXIT_OK
            run = slurm_target.submit(args.config, out, steps=args.steps, timeout_s=args.timeout, nodes=args.nodes,
                                      per_node=args.gpus_per_node, fresh=args.fresh, **opts)
    except ClusterError as exc:
        raise CliError(str(exc)) from None
    return cluster_run_cli(run, json_events=args.json)


def cmd_measure(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if not args.fake:
        raise CliError("measure needs --fake (simulate ranks on a fake process group); "
                       "`shardscope run` measures a real run")
    world = cfg.parallel.world_size
    if args.rank is not None and not 0 <= args.rank < world:
        raise CliError(f"--rank {args.rank} is outside the world of {world} ranks (0..{world - 1})")
    from backend.fake import measure_cli

    ranks = None if args.rank is None else [args.rank]
    return measure_cli(args.config, ranks=ranks, out_dir=args.out, json_out=args.json, timeout_s=args.timeout,
                       expandable_segments=True if args.expandable_segments else None, fresh=args.fresh)


def cmd_plan(args: argparse.Namespace) -> int:
    """``shardscope plan``: a readable table or JSON; argument errors are one clean message, exit 2.

    ``--float8 none,tensorwise,rowwise`` and ``--compile on,off`` choose the float8 kinds and torch.compile
    settings searched (default: every float8 kind the GPU and precision allow, compile on and off).
    ``--config CFG`` plans that config's job instead of ``--model``/``--gpus``/``--gpu``/``--gpus-per-node``. ``--all-fitting`` adds every fitting layout
    (``fitting`` and ``base_config`` in the JSON). ``--progress`` writes JSON lines instead:
    ``{"event": "progress", "phase": "top" | "fitting", "evaluated": k, "total": n}`` as the search
    goes (at most ten a second), then ``{"event": "result", "result": {...}}`` (or
    ``{"event": "error", "argument": ..., "message": ...}``).
    """
    import json
    import time
    from typing import Any

    from engine import Config, ConfigError, names
    from engine.plan.results import PlanError
    from engine.plan.search import plan, plan_config
    from gui.text import plan_table

    def usage(message: str) -> int:
        print(f"shardscope plan: {message}", file=sys.stderr)
        return 2

    base = None
    config = getattr(args, "config", None)
    if config is not None:
        given = [flag for flag, name in (("--model", "model"), ("--gpus", "gpus"), ("--gpu", "gpu"),
                                         ("--gpus-per-node", "gpus_per_node")) if getattr(args, name, None) is not None]
        if given:
            return usage(f"--config takes the model and the cluster from the config; leave out {', '.join(given)}")
        if not Path(config).is_file():
            return usage(f"--config: config file not found: {config}")
        try:
            base = Config.load(config)
        except (ConfigError, OSError, ValueError) as exc:
            return usage(f"--config {config}: {exc}")
    else:
        missing = [flag for flag, name in (("--model", "model"), ("--gpus", "gpus")) if getattr(args, name, None) is None]
        if missing:
            return usage(f"needs {' and '.join(missing)} (or --config CFG)")
        args.gpu = "h100-sxm" if getattr(args, "gpu", None) is None else args.gpu
        args.gpus_per_node = 8 if getattr(args, "gpus_per_node", None) is None else args.gpus_per_node
    all_fitting = bool(getattr(args, "all_fitting", False))
    limits = [getattr(args, name, None) for name in ("fitting_limit", "fitting_seconds")]
    if any(v is not None for v in limits) and not all_fitting:
        return usage("--fitting-limit and --fitting-seconds limit --all-fitting; add --all-fitting")
    stream = bool(getattr(args, "progress", False))
    if stream and not args.json:
        return usage("--progress writes JSON lines; add --json")

    kwargs: dict[str, Any] = {}
    float8 = getattr(args, "float8", None)
    if float8 is not None:
        kinds = tuple(k.strip() for k in str(float8).split(",") if k.strip())
        bad = [k for k in kinds if k not in names.FLOAT8_KINDS]
        if bad or not kinds:
            return usage(f"--float8: allowed: a comma-separated list of {', '.join(names.FLOAT8_KINDS)}; got {float8!r}")
        kwargs["float8"] = kinds
    compile_ = getattr(args, "compile", None)
    if compile_ is not None:
        words = [w.strip() for w in str(compile_).split(",") if w.strip()]
        if not words or any(w not in ("on", "off") for w in words):
            return usage(f"--compile: allowed: a comma-separated list of on, off; got {compile_!r}")
        kwargs["compile"] = tuple(w == "on" for w in words)
    for name in ("global_batch", "max_virtual_stages", "seq_len"):
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    if getattr(args, "runnable", False):
        kwargs["runnable_only"] = True
    if all_fitting:
        kwargs["all_fitting"] = True
        for name in ("fitting_limit", "fitting_seconds"):
            value = getattr(args, name, None)
            if value is not None:
                kwargs[name] = value
    last = [0.0]

    def emit(event: dict) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    if stream:
        def progress(evaluated: int, total: int) -> None:
            now = time.perf_counter()
            if evaluated in (0, total) or now - last[0] >= 0.1:
                last[0] = now
                emit({"event": "progress", "phase": "fitting", "evaluated": evaluated, "total": total})

        kwargs["progress"] = progress
        emit({"event": "progress", "phase": "top", "evaluated": 0, "total": 0})
    try:
        if base is not None:
            result = plan_config(base, top=args.top, **kwargs)
        else:
            result = plan(args.model, args.gpus, args.gpu, args.gpus_per_node, top=args.top, **kwargs)
    except PlanError as exc:
        flag = "--config" if exc.argument in ("config", "training") and base is not None else \
            f"--{exc.argument.replace('_', '-')}"
        if stream:
            emit({"event": "error", "argument": exc.argument, "message": f"{flag}: {exc.message}"})
        print(f"shardscope plan: {flag}: {exc.message}", file=sys.stderr)
        return 2
    if stream:
        emit({"event": "result", "result": result.to_json()})
    elif args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(plan_table(result))
    return 0 if result.entries else 1


def _calibrate_device(args: argparse.Namespace) -> int:
    """``calibrate --device``: this machine's CPU profile for the clock from ops, in a child process with a
    rank's one OpenMP thread (backend.devicebench), kept where the engine reads it for gpu = "cpu"."""
    import json
    import os
    import subprocess

    from engine.time.ops import RECOMPUTE_LAUNCH, measured_profile_path

    out = Path(args.out) / "device-cpu.json" if args.out else measured_profile_path()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    root = Path(__file__).resolve().parents[1]
    print("measuring this machine's CPU as one rank sees it (GEMMs, bandwidth, per-op dispatch; ~15 s) …",
          flush=True)
    try:
        done = subprocess.run([sys.executable, "-m", "backend.devicebench", "--out", str(out)], cwd=str(root),
                              env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise CliError(f"the device benchmark did not finish in {args.timeout:g} s", EXIT_FAILED) from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise CliError("the device benchmark failed: " + " | ".join(tail), EXIT_FAILED)
    doc = json.loads(out.read_text())
    if args.json:
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    prof, raw = doc["profile"], doc["raw"]
    print(f"GEMM fp32 {raw['gemm']['fp32']['rate_flops'] / 1e9:.1f} GFLOP/s (large), bf16 "
          f"{raw['gemm']['bf16']['rate_flops'] / 1e9:.1f}; half rate at {prof['gemm_half_gflop']:.4f} GFLOP (bf16 {prof['gemm_half_gflop_bf16']:.4f}); "
          f"bandwidth {raw['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (softmax {raw['softmax_bytes_per_s'] / 1e9:.1f}); "
          f"per-op cost {prof['launch_us']:.1f} µs forward, "
          f"{prof['launch_backward_us']:.1f} µs backward"
          + "".join(f"; under recompute = {kind}: {prof[f'launch_us_{suffix}']:.1f} / "
                    f"{prof[f'launch_backward_us_{suffix}']:.1f}" for kind, suffix in RECOMPUTE_LAUNCH.items()
                    if f"launch_us_{suffix}" in prof)
          + "".join(f"; float8 GEMMs {raw['gemm'][k]['rate_flops'] / 1e9:.3g} GFLOP/s ({k[4:]} kernel)"
                    for k in ("fp8_tensorwise", "fp8_rowwise") if k in raw["gemm"])
          + (f"; in a chain of blocks ops run {prof['context_forward']:.2f} × their time alone forward, "
             f"{prof['context_backward']:.2f} × backward (bf16: {prof.get('context_forward_bf16', 0):.2f} / "
             f"{prof.get('context_backward_bf16', 0):.2f})" if "context_forward" in prof else "")
          + f" ({doc['seconds']:.0f} s)")
    print(f"written: {out} — predictions with gpu = \"cpu\" and conventions.clock = \"ops\" on this machine use it")
    return EXIT_OK


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``calibrate --links``: time this machine's collectives and matmuls, fit α and β per collective;
    ``calibrate --device``: this machine's CPU profile for the clock from ops."""
    import json

    if args.links and args.device:
        raise CliError("calibrate takes --links or --device, not both: run it twice")
    if args.device:
        return _calibrate_device(args)
    if not args.links:
        raise CliError("calibrate needs --links (measure this machine's collectives) or --device (its CPU, for "
                       "conventions.clock = \"ops\"); a finished run calibrates with "
                       "`shardscope predict CONFIG --calibration RUN_DIR`")
    if args.ranks < 2:
        raise CliError(f"--ranks {args.ranks}: a collective needs at least 2 ranks")
    from backend.launch import default_run_dir
    from backend.linkbench import LinkBenchError, measure_links, render_links

    out = Path(args.out) if args.out else Path(str(default_run_dir()) + "-links")
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {args.out}: exists and is not a directory")
    try:
        cal = measure_links(args.ranks, out, timeout_s=args.timeout)
    except LinkBenchError as exc:
        raise CliError(str(exc), EXIT_FAILED) from None
    if args.json:
        print(json.dumps(cal.to_json(), indent=2))
    else:
        print(render_links(cal))
        print(f"written: {out / 'links.json'}")
    return EXIT_OK


def _no_display() -> bool:
    """On Linux, Qt aborts the process when it finds no screen; say so first, in words."""
    import os

    return (sys.platform.startswith("linux") and not os.environ.get("QT_QPA_PLATFORM")
            and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"))


def cmd_gui(args: argparse.Namespace) -> int:
    runs_dir = getattr(args, "runs_dir", None)
    if runs_dir and Path(runs_dir).exists() and not Path(runs_dir).is_dir():
        raise CliError(f"--runs-dir {runs_dir}: exists and is not a directory; name a directory (it is made "
                       "on the first run)")
    if getattr(args, "config", None):
        _load(args.config)
    if _no_display() and not getattr(args, "screenshot", None):
        raise CliError("no display to open the window on (DISPLAY and WAYLAND_DISPLAY are unset): run it in a "
                       "desktop session or under xvfb-run, or use the command line (shardscope --help) or "
                       "shardscope gui --screenshot OUT.png")
    if not getattr(args, "screenshot", None):
        import os

        from gui.platform_check import xcb_problem

        problem = xcb_problem(dict(os.environ))
        if problem:  # Qt would abort with "no Qt platform plugin could be initialized"
            raise CliError(problem)
    from gui.app import run_app

    return run_app(config_path=getattr(args, "config", None), screenshot=getattr(args, "screenshot", None),
                   plan=bool(getattr(args, "plan", False)), runs_dir=runs_dir)


def cmd_presets(args: argparse.Namespace) -> int:
    from engine.model.presets import cluster_presets, gpu_presets, model_presets

    for title, table in (("models", model_presets()), ("gpus", gpu_presets()), ("clusters", cluster_presets())):
        print(f"{title}: {', '.join(table)}")
    return EXIT_OK


# --------------------------------------------------------------------------- parser


def _out_arguments(p: argparse.ArgumentParser, default: str) -> None:
    """``--out`` and ``--fresh``: where a run or a simulation writes (a run directory is written once)."""
    p.add_argument("--out", metavar="RUN_DIR", help=f"run directory (default: {default}); a directory that "
                                                    "already holds anything is refused, never overwritten")
    p.add_argument("--fresh", action="store_true", help="write into a new timestamped sub-directory of --out")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardscope",
        description="Predict memory and pipeline timelines per GPU for a distributed-training layout, "
                    "run the same layout for real, and compare. Without a command: open the window.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("gui", help="open the window (optionally on a config; --screenshot renders offscreen)")
    p.add_argument("--config", help="a config file (TOML or JSON)")
    p.add_argument("--screenshot", metavar="OUT.png", help="render the window offscreen to this PNG and exit")
    p.add_argument("--plan", action="store_true",
                   help="with --screenshot: run the Planner tab's plan for the config first and show it")
    p.add_argument("--runs-dir", metavar="DIR",
                   help="where the window keeps its runs and finds earlier ones (default: the per-user data "
                        "folder, ~/.local/share/shardscope/runs on Linux, or $SHARDSCOPE_RUNS_DIR)")
    p.set_defaults(func=cmd_gui)

    p = sub.add_parser("validate", help="check config files; every problem names its field")
    p.add_argument("configs", nargs="+", metavar="CONFIG")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("predict", help="memory per rank and pipeline timeline for a config")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--explain", action="store_true", help="show the terms behind every number")
    p.add_argument("--over-step", action="store_true",
                   help="each memory category at its own worst moment of the step, not at the rank's peak moment")
    p.add_argument("--calibration", metavar="RUN_DIR",
                   help="predict time with durations, efficiency and bandwidths measured by this run")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("compare", help="predicted vs measured per rank and category for a finished run")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("run", help="run the config as real multi-process PyTorch training and measure it")
    p.add_argument("config", metavar="CONFIG")
    _out_arguments(p, "<runs>/<timestamp>, <runs> the per-user data folder's runs/")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped as hung")
    p.add_argument("--json", action="store_true", help="print one JSON event per line")
    p.add_argument("--target", choices=("local", "slurm", "hosts"), default="local",
                   help="where the ranks run: this machine (default), a Slurm job (sbatch), or hosts "
                        "you start one command on each (the run directory must be on a shared filesystem)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--nodes", type=int, help="nodes (default: from the config's cluster)")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="ranks per node (default: from the config)")
    p.add_argument("--time", metavar="LIMIT", help="Slurm time limit, e.g. 00:30:00")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--hosts", metavar="A,B,...", help="hosts for --target hosts; the first hosts the rendezvous "
                                                      "(A:PORT sets its port, default 29500)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sbatch script (slurm) or the per-host commands (hosts) and stop")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("measure", help="simulate ranks of a config on a fake process group and compare "
                                       "with the prediction (no hardware needed)")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--fake", action="store_true", help="fake process group + fake tensors (required)")
    p.add_argument("--rank", type=int, help="the rank to simulate (default: one per pipeline stage)")
    _out_arguments(p, "<runs>/<timestamp>-fake")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the simulation is stopped")
    p.add_argument("--json", action="store_true", help="the measurement and the comparison as JSON")
    p.add_argument("--expandable-segments", action="store_true",
                   help="replay each rank's allocations through the caching allocator with "
                        "expandable_segments:True (default: the config's convention, else torch's default False)")
    p.set_defaults(func=cmd_measure)

    _add_plan(sub)
    _add_calibrate(sub)
    from gui.cli_interop import add_parsers

    add_parsers(sub)

    p = sub.add_parser("presets", help="list the model, GPU and cluster presets")
    p.set_defaults(func=cmd_presets)
    return parser


def _add_plan(sub) -> None:
    """``shardscope plan``'s arguments."""
    p = sub.add_parser("plan", help="rank every valid layout of a model on N GPUs by predicted throughput",
                       description="Rank every valid layout of a model on N GPUs by predicted throughput. "
                                   "Give --model and --gpus (and --gpu, --gpus-per-node), or --config CFG.")
    p.add_argument("--model", help="a model preset (required without --config)")
    p.add_argument("--gpus", type=int, help="the GPU count (required without --config)")
    p.add_argument("--gpu", help="a GPU preset (default h100-sxm)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    p.add_argument("--config", metavar="CFG",
                   help="plan this config's job instead: its model (preset or custom), its cluster as it is "
                        "(GPU kind, count, GPUs per node, links), its precision, optimizer and conventions; "
                        "its own layout, micro-batch size and recompute are what is searched")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--global-batch", type=int, metavar="SEQUENCES",
                   help="sequences per step, the same for every layout (default: with --config the config's "
                        "own; else about 4 Mi tokens, a multiple of --gpus, at most 8 per GPU)")
    p.add_argument("--max-virtual-stages", type=int, default=8, metavar="V",
                   help="largest virtual stages per rank tried for the interleaved schedules (default 8)")
    p.add_argument("--seq-len", type=int, metavar="TOKENS",
                   help="train at this sequence length (default: the model's); from 16384 tokens the planner "
                        "searches context parallelism (cp) too")
    p.add_argument("--float8", metavar="KINDS",
                   help="comma-separated torchao float8 kinds to search, from none,tensorwise,rowwise (default: all "
                        "three where the GPU has float8 tensor cores and precision is bf16-mixed, else none)")
    p.add_argument("--compile", metavar="SETTINGS",
                   help="comma-separated torch.compile settings to search, from on,off (default: on,off)")
    p.add_argument("--json", action="store_true", help="the result as one JSON document")
    p.add_argument("--runnable", action="store_true",
                   help="only layouts ShardScope's backend can run (others are marked 'predict only')")
    p.add_argument("--all-fitting", action="store_true",
                   help="also fully evaluate every layout that passes the memory lower bound, best bound first, "
                        "and list those that fit with the Pareto front of tokens/s against peak memory per GPU "
                        "(JSON: \"fitting\" and \"base_config\"; the table shows the count)")
    p.add_argument("--fitting-limit", type=int, metavar="N",
                   help="--all-fitting evaluates at most N layouts (default 10000)")
    p.add_argument("--fitting-seconds", type=float, metavar="S",
                   help="--all-fitting stops after S seconds (default 30)")
    p.add_argument("--progress", action="store_true",
                   help="with --json: JSON lines, {\"event\": \"progress\", \"phase\", \"evaluated\", \"total\"} "
                        "as the search goes, then {\"event\": \"result\", \"result\": {...}} "
                        "(or {\"event\": \"error\", ...})")
    p.set_defaults(func=cmd_plan)


def _add_calibrate(sub) -> None:
    """``shardscope calibrate``'s arguments."""
    p = sub.add_parser("calibrate", help="measure this machine: collectives' latency and bandwidth and the "
                                         "matmul FLOP/s per rank (torchrun micro-benchmark, 10–60 s)")
    p.add_argument("--links", action="store_true", help="time all-reduce / all-gather / reduce-scatter / send-recv "
                                                        "over a sweep of sizes and fit α and β per collective")
    p.add_argument("--device", action="store_true", help="time this machine's CPU as one rank sees it (GEMMs, "
                                                         "bandwidth, per-op dispatch): the profile conventions.clock = "
                                                         "\"ops\" uses for gpu = \"cpu\" (kept in ~/.cache/shardscope)")
    p.add_argument("--ranks", type=int, default=4, help="ranks to measure with (default 4: the default config's)")
    p.add_argument("--out", metavar="DIR", help="where links.json (or, with --device, device-cpu.json) goes "
                                                "(default: <runs>/<timestamp>-links; --device: this machine's cache)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds before the benchmark is stopped")
    p.add_argument("--json", action="store_true", help="the fitted calibration as JSON")
    p.set_defaults(func=cmd_calibrate)


def main(argv: Sequence[str] | None = None) -> int:
    from engine import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args.func = cmd_gui
    try:
        return args.func(args)
    except ConfigError as exc:
        where = getattr(args, "config", None)
        print(f"shardscope: {where + ': ' if where else ''}{exc}", file=sys.stderr)
        return EXIT_USAGE
    except CliError as exc:
        print(f"shardscope: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("shardscope: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:  # a file or disk problem that no command worded itself: one line, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"shardscope: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

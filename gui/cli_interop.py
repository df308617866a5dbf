"""``shardscope import`` and ``shardscope export``: the launchers' languages (engine.interop).

    shardscope import torchtitan|accelerate|deepspeed|megatron|hf [--gpus N] [--gpu PRESET] [--cluster PRESET]
                      [--model PRESET | --hf CONFIG.json] [--set SECTION.FIELD=VALUE ...] [-o OUT.toml] FILE [ARGS...]
    shardscope export torchtitan|accelerate|deepspeed|megatron CONFIG [--as command|toml] [-o OUT]

``import`` reads FILE (``-``: standard input) — a torchtitan TOML job config, or a file holding a command
line (torchrun ... train.py ..., run_train.sh with NGPU=) — applies torchtitan's own command-line ARGS after
it, and prints the ShardScope config (or writes it to OUT, never over an existing file). Every field that
did not carry over is named on standard error. ``export`` prints the layout in the launcher's language, the
fields it cannot express as comments and on standard error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gui.interop_files import EXPORT_FORMATS
from gui.interop_files import IMPORT_FORMATS as FORMATS


def _write(text: str, out: str | None) -> None:
    from gui.cli import CliError

    if out is None:
        sys.stdout.write(text)
        return
    path = Path(out)
    if path.exists():
        raise CliError(f"-o {out}: the file exists; ShardScope never writes over a file (choose another name)")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    print(f"shardscope: wrote {out}", file=sys.stderr)


def _value(text: str):
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _extra(args: argparse.Namespace) -> dict:
    """The ShardScope fields the user gives beside the launcher's file: --model, --hf, --set SECTION.FIELD=VALUE."""
    from gui.cli import CliError

    extra: dict = {}
    if args.model and args.hf:
        raise CliError("--model and --hf: give one of them (a preset, or a Hugging Face config.json)")
    if args.model:
        extra["model"] = {"preset": args.model}
    if args.hf:
        hf = Path(args.hf)
        if not hf.is_file():
            raise CliError(f"--hf {args.hf}: not found (a Hugging Face config.json)")
        extra["model"] = {"hf_config": str(hf.resolve())}
    for item in args.set or []:
        key, eq, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not (eq and dot and section in ("model", "cluster", "parallel", "training", "conventions") and field):
            raise CliError(f"--set {item}: allowed SECTION.FIELD=VALUE with SECTION one of model, cluster, parallel, "
                           "training, conventions (e.g. --set training.micro_batch_size=2)")
        extra.setdefault(section, {})[field] = _value(value)
    return extra


def _read(args: argparse.Namespace) -> tuple[str, Path]:
    from gui.cli import CliError

    if args.file == "-":
        return sys.stdin.read(), Path.cwd()
    path = Path(args.file)
    if not path.is_file():
        raise CliError(f"FILE {args.file}: not found (the launcher's config, or a file holding its command)")
    return path.read_text(encoding="utf-8"), path.parent


def cmd_import(args: argparse.Namespace) -> int:
    import tomli_w

    from engine.interop import InteropError, compact_dict
    from gui.cli import EXIT_OK, CliError
    from gui.interop_files import import_text

    text, base = _read(args)
    cluster: dict = {}
    if args.gpu:
        cluster["gpu"] = args.gpu
    if args.cluster:
        cluster["preset"] = args.cluster
    if args.gpus is not None and args.gpus < 1:
        raise CliError(f"--gpus {args.gpus}: must be at least 1")
    extra = _extra(args)
    try:
        got = import_text(args.format, text, path=None if args.file == "-" else args.file, base=base,
                          args=list(args.args), gpus=args.gpus, cluster=cluster, extra=extra)
    except InteropError as exc:
        raise CliError(str(exc)) from None
    flavour = f" ({got.flavour})" if got.flavour.lower() != args.format else ""
    head = [f"# imported from {args.format}{flavour}: {args.file}"]
    head += [f"# not expressed: {n}" for n in got.not_expressed]
    head += [f"# assumed: {n}" for n in got.assumed]
    for line in (*[f"not expressed: {n}" for n in got.not_expressed], *[f"assumed: {n}" for n in got.assumed]):
        print(f"shardscope: {line}", file=sys.stderr)
    if got.ignored:
        print(f"shardscope: ignored (no bearing on memory or step time): {', '.join(got.ignored)}", file=sys.stderr)
    _write("\n".join(head) + "\n" + tomli_w.dumps(compact_dict(got.config)), args.out)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from engine.interop import InteropError
    from gui.cli import EXIT_OK, CliError, _load
    from gui.interop_files import export_text

    cfg = _load(args.config)
    try:
        got = export_text(args.format, cfg, args.form)
    except InteropError as exc:
        raise CliError(str(exc)) from None
    for note in got.not_expressed:
        print(f"shardscope: not expressed: {note}", file=sys.stderr)
    _write(got.text, args.out)
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    import json

    from gui.cli import EXIT_OK, CliError, _load, _run_dir
    from gui.report import build_report

    cfg = _load(args.config)
    comparison = plan = None
    if args.run:
        from engine.compare.measured import compare
        from engine.predict import predict
        from gui.text import comparison_table

        d = _run_dir(args.run)
        try:
            meas = json.loads((d / "measurement.json").read_text(encoding="utf-8"))
            comparison = comparison_table(compare(predict(cfg), meas))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CliError(f"{d / 'measurement.json'} is not a readable measurement ({exc})") from None
    if args.plan:
        from engine.plan.results import PlanError
        from engine.plan.search import plan_config
        from gui.text import plan_table

        if args.top < 1:
            raise CliError(f"--top {args.top}: must be at least 1")
        try:
            plan = plan_table(plan_config(cfg, top=args.top))
        except PlanError as exc:
            raise CliError(f"--plan: {exc}") from None
    _write(build_report(cfg, comparison_text=comparison, plan_text=plan, source=args.config), args.out)
    return EXIT_OK


def add_parsers(sub) -> None:
    p = sub.add_parser("import", help="a launcher's config (torchtitan, accelerate, DeepSpeed, Megatron-LM, a "
                                      "Hugging Face config.json) as a ShardScope config",
                       description="Read a launcher's config; torchtitan arguments after FILE apply on top. What the "
                                   "file does not hold (accelerate's and DeepSpeed's model and batch) comes from "
                                   "--model / --hf / --set; fields that do not carry over are named.")
    p.add_argument("format", choices=FORMATS)
    p.add_argument("--gpus", type=int, help="the world size where the file does not give it (torchrun's --nnodes × "
                                            "--nproc_per_node; DeepSpeed's launcher)")
    p.add_argument("--gpu", help="the card, a GPU preset (`shardscope presets`); default h100-sxm")
    p.add_argument("--cluster", help="a cluster preset (card and links)")
    p.add_argument("--model", help="the model preset, where the file does not name one (accelerate, DeepSpeed)")
    p.add_argument("--hf", metavar="CONFIG.json", help="the model as a Hugging Face config.json (accelerate, DeepSpeed)")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE",
                   help="any ShardScope field, set last (repeatable): --set training.micro_batch_size=2")
    p.add_argument("-o", "--out", help="write the config here (never over an existing file); default: print it")
    p.add_argument("file", metavar="FILE", help="the launcher's config or command (- for standard input)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="torchtitan's own command-line arguments, applied after FILE")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="a ShardScope config in a launcher's language (torchtitan, accelerate, DeepSpeed, "
                                      "Megatron-LM)")
    p.add_argument("format", choices=EXPORT_FORMATS)
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--as", dest="form", choices=("command", "toml"), default="command",
                   help="torchtitan: 0.3's command line (default) or a 0.2 job config TOML")
    p.add_argument("-o", "--out", help="write here (never over an existing file); default: print it")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="one self-contained HTML file: layout, metrics, memory per rank, timeline, "
                                      "the planner's top layouts, predicted vs measured")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--run", metavar="RUN_DIR", help="a finished run of this config: predicted vs measured")
    p.add_argument("--plan", action="store_true", help="also plan the config's job and list the top layouts")
    p.add_argument("--top", type=int, default=5, help="with --plan: how many layouts (default 5)")
    p.add_argument("-o", "--out", required=True, help="the HTML file to write (never over an existing file)")
    p.set_defaults(func=cmd_report)

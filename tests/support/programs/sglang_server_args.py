"""Real SGLang's server-argument parser, run in a process of its own (its import chain needs the
GPU-only stand-ins of ``beam_hpc.backends.miles.parser_check``, which must not leak into a test).

``python sglang_server_args.py dump``: one JSON object per accepted action on stdout
(``{"flags": [...], "nargs": ..., "dest": ..., "default": ...}``), what the written contract
``tests/support/fixtures/sglang-server-flags.txt`` is made from.
``python sglang_server_args.py parse -- <server flags>``: ``ServerArgs.add_cli_args``'s parser on the
flags; prints ``{"ok": true, "args": {dest: value}}`` or ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys

ZERO = "0"  # a switch (store_true / store_false / store_const): no value


def _parser() -> argparse.ArgumentParser:
    from beam_hpc.backends.miles.parser_check import install_stand_ins

    install_stand_ins()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _jsonable(value: object) -> object:
    try:
        json.dumps(value)
    except TypeError:
        return None
    return value


def dump() -> list[dict[str, object]]:
    out = []
    for action in _parser()._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags or action.dest == "help":
            continue
        nargs = ZERO if action.nargs == 0 else ("1" if action.nargs is None else str(action.nargs))
        out.append({"flags": flags, "nargs": nargs, "dest": action.dest, "default": _jsonable(action.default)})
    return out


def parse(argv: list[str]) -> dict[str, object]:
    parser = _parser()
    try:
        ns, extra = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as err:
        return {"ok": False, "error": str(err)}
    if extra:
        return {"ok": False, "error": f"unrecognized arguments: {' '.join(extra)}"}
    return {"ok": True, "args": {k: _jsonable(v) for k, v in vars(ns).items()}}


def main() -> int:
    if sys.argv[1:2] == ["dump"]:
        for record in dump():
            print(json.dumps(record))
        return 0
    if sys.argv[1:3] == ["parse", "--"]:
        print(json.dumps(parse(sys.argv[3:])))
        return 0
    print("usage: sglang_server_args.py dump | parse -- <flags>", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

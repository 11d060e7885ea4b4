"""``beam-hpc nodes [--site S] [--json]`` and ``beam-hpc nodes release NAME... [--site S]``: the
site's node quarantine (beam_hpc.lifecycle.quarantine) for people.

Registered by beam_hpc/cli/app.py (PLUGIN_MODULES). Exit codes: 0 listed or released; 2 a site
without a quarantine file, a damaged file, or a name that is not quarantined; 1 the file's lock
stayed held.
"""

from __future__ import annotations

import argparse
import json
import time

from beam_hpc.errors import InputError


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("nodes", help="list the site's quarantined nodes (failed in some run; left out of every run)")
    p.add_argument("--site", default=None, help="site profile: a path or a name under env/ (default: local)")
    p.add_argument("--json", action="store_true", help="print the entries as JSON")
    p.set_defaults(func=cmd_nodes)
    sub = p.add_subparsers(dest="nodes_command")
    r = sub.add_parser("release", help="let quarantined nodes back into every run of the site")
    r.add_argument("names", nargs="+", metavar="NAME", help="node name as Slurm spells it")
    r.add_argument("--site", default=argparse.SUPPRESS, help="site profile (also accepted before `release`)")
    r.set_defaults(func=cmd_release)


def _quarantine_file(site_arg: str | None) -> str:
    from beam_hpc.submission.submit import build_site

    site = build_site(site_arg)
    if not site.quarantine:
        raise InputError(f"quarantine: site {site.name!r} names no quarantine file; add e.g. "
                         "`quarantine: /shared/beam/bad-nodes.json` (and `quarantine_days: 7`) to its profile")
    return site.quarantine


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def cmd_nodes(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from beam_hpc.lifecycle.quarantine import quarantined

    path = _quarantine_file(args.site)
    entries = quarantined(path)
    if args.json:
        print(json.dumps({"file": path, "nodes": [asdict(e) for e in entries]}, indent=1, sort_keys=True))
        return 0
    if not entries:
        print(f"no node quarantined ({path})")
        return 0
    print(f"{len(entries)} node(s) quarantined ({path}); release one with `beam-hpc nodes release NAME`")
    for e in entries:
        print(f"{e.node}  until {_when(e.expires)}  since {_when(e.time)}  run {e.run} ({e.run_dir}) "
              f"segment {e.segment}: {e.why}")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from beam_hpc.lifecycle.quarantine import release

    path = _quarantine_file(args.site)
    for e in release(path, args.names):
        print(f"released {e.node} (quarantined since {_when(e.time)} by run {e.run}: {e.why})")
    return 0

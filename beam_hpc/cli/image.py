"""``beam-hpc image build [--runtime apptainer|enroot]|stage|verify``: the CLI face of :mod:`beam_hpc.node.image` (registered by
beam_hpc/cli/app.py). Errors are :class:`beam_hpc.node.image.ImageError` (exit 1), or its
ImagePathError for a missing or wrong path (exit 2); cli/app.py turns them into the exit code.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("image", help="build, stage or verify the image",
                              description="The image the Miles backend runs in (Apptainer .sif, or a squashfs for pyxis).")
    sub = p.add_subparsers(dest="image_command", required=True)

    b = sub.add_parser("build", help="build from apptainer.def: apptainer build, or enroot for pyxis sites "
                       "(cache and tmp on local disk)")
    b.add_argument("--runtime", choices=("apptainer", "enroot"), default="apptainer",
                   help="apptainer: a .sif; enroot: a squashfs for pyxis (enroot import of the def file's From: "
                   "image, then its %%files, %%post and %%environment) (default: %(default)s)")
    b.add_argument("--def", dest="def_file", default="apptainer.def", help="definition file (default: %(default)s)")
    b.add_argument("--output", "-o", default=None, help="image to write (default: beam.sif, or beam.sqsh for enroot)")
    b.add_argument("--tag", default=None, help="Miles image tag (default: the def file's, beam)")
    b.add_argument("--local-dir", default=None, help="local disk for the builder's cache and tmp (default: "
                   "/tmp/beam-<runtime>-$UID; APPTAINER_CACHEDIR/TMPDIR or ENROOT_*_PATH win when set)")
    b.add_argument("--force", action="store_true", help="overwrite an existing image")
    b.add_argument("--dry-run", action="store_true", help="enroot: print the commands (and build script), run nothing")
    b.set_defaults(func=_build)

    s = sub.add_parser("stage", help="copy the image to node-local disk once per node, sha256-checked")
    s.add_argument("--image", default=None, help="the .sif (default: the site's container.image)")
    s.add_argument("--dest", default=None, help="node-local directory (default: <site scratch>/beam-images)")
    s.add_argument("--site", default=None, help="site profile: a path or a name under env/")
    s.set_defaults(func=_stage)

    v = sub.add_parser("verify", help="import and version-check torch, megatron.core, sglang, ray, deepspeed")
    v.set_defaults(func=_verify)


def _build(args: argparse.Namespace) -> int:
    from beam_hpc.node.image import DEFAULT_OUTPUT, DEFAULT_SQUASHFS, ImagePathError, build_enroot_image, build_image

    if args.runtime == "enroot":
        out = build_enroot_image(args.def_file, args.output or DEFAULT_SQUASHFS, tag=args.tag,
                                 local_dir=args.local_dir, force=args.force, dry_run=args.dry_run)
        if args.dry_run:
            return 0
    else:
        if args.dry_run:
            raise ImagePathError("--dry-run: only with --runtime enroot")
        out = build_image(args.def_file, args.output or DEFAULT_OUTPUT, tag=args.tag, local_dir=args.local_dir,
                          force=args.force)
    print(f"built {out} (checksum in {out}.sha256)")
    return 0


def _stage(args: argparse.Namespace) -> int:
    from beam_hpc.node.image import ImagePathError, stage

    image, dest = args.image, args.dest
    if image is None or dest is None:
        from beam_hpc.config.site import find_site, load_site

        site = load_site(find_site(args.site or "local"))
        image = image or site.container.image
        if dest is None and not site.scratch:
            raise ImagePathError(f"site {site.name}: no scratch (node-local disk) set; pass --dest")
        dest = dest or str(Path(site.scratch or "", "beam-images"))
    if not image:
        raise ImagePathError("no image: pass --image or set container.image in the site profile")
    res = stage(image, dest)
    print(f"{res.path}: {'copied and verified' if res.copied else 'already staged and valid'}")
    for old in res.removed:
        print(f"removed older copy {old}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from beam_hpc.node.image import verify_stack

    checks = verify_stack()
    for c in checks:
        need = f" (>= {c.minimum})" if c.minimum else ""
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.module} {c.version or '-'}{need}" + (f": {c.error}" if c.error else ""))
    return 0 if all(c.ok for c in checks) else 1

"""Contract double of Miles's ``tools/convert_hf_to_torch_dist.py`` (radixark/miles@31f1ca961), tests only.

Miles's converter needs CUDA, NCCL, Megatron and mbridge, none of which run here. What beam-hpc's
conversion job relies on, and what this double therefore does the same way:

- it is started by torchrun, one process per GPU: rank, world size and local rank come from
  ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (else ``SLURM_PROCID`` / ``SLURM_NTASKS`` /
  ``SLURM_LOCALID``, as Miles reads them), and all ranks join one process group (gloo here,
  NCCL in Miles);
- flags: ``--hf-checkpoint`` and ``--save`` are required, and the Megatron architecture flags
  must include ``--num-layers`` (Megatron's parser requires the model's shape); other flags are
  accepted;
- it saves iteration 1, moves ``iter_0000001`` to ``release``, waits on a barrier, and only then
  rank 0 writes ``release`` into ``latest_checkpointed_iteration.txt``: the last step, which
  callers read as success.

The checkpoint itself is a small real megatron-core torch_dist checkpoint from
``tests/support/builders/miles/megatron_ckpt.py`` (not the HF weights: there are none here). Each rank records its argv
and environment in ``<--save>.standin/rank-<r>.json`` beside the output, so a test can check what
the job ran.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[3] / "builders" / "miles"  # megatron_ckpt


def main() -> None:
    p = argparse.ArgumentParser(prog="convert_hf_to_torch_dist.py (contract double)")
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--num-layers", type=int, required=True)
    args, _unknown = p.parse_known_args()
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    local = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)
    record_dir = Path(args.save + ".standin")
    record_dir.mkdir(parents=True, exist_ok=True)
    names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "MILES_DIR",
             "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "LOADEDMODULES", "BEAM_MODULE_RAN", "BEAM_PARITY_SITE")
    record = {"argv": sys.argv, "rank": rank, "world": world, "local_rank": local,
              "env": {k: os.environ[k] for k in names if k in os.environ}}
    (record_dir / f"rank-{rank}.json").write_text(json.dumps(record, indent=1))

    import torch.distributed as dist

    dist.init_process_group("gloo", world_size=world, rank=rank)
    save = Path(args.save)
    if rank == 0:
        sys.path.insert(0, str(TESTS))
        from megatron_ckpt import write_torch_dist_checkpoint

        write_torch_dist_checkpoint(save, 1, seed=0, dataset_state=False)
        shutil.move(str(save / "iter_0000001"), str(save / "release"))
    dist.barrier()
    if rank == 0:  # Miles: "must be the *last* step and after a dist.barrier"
        (save / "latest_checkpointed_iteration.txt").write_text("release")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

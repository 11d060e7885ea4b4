"""Small, real Megatron ``torch_dist`` checkpoints in Miles's layout, written by megatron-core on the CPU.

Why this exists: the checkpoint check (``beam_hpc.backends.miles.checkpoint``) and the Miles stand-in
driver need checkpoints that are what Miles saves on a cluster, not a look-alike; megatron-core's own
``dist_checkpointing.save`` writes them here (a one-process gloo group, a few ``ShardedTensor`` s and a
``ShardedObject``, a common state shaped like Megatron's: ``iteration``, ``args``,
``checkpoint_version``, ``opt_param_scheduler``...). Layout, as Miles (Megatron) leaves it::

    <save_dir>/iter_0000019/{common.pt, __0_0.distcp, __0_1.distcp, .metadata, metadata.json}
    <save_dir>/rollout/global_dataset_state_dict_19.pt      Miles's data cursor for rollout 19
    <save_dir>/latest_checkpointed_iteration.txt           "19", written last

Use from Python (``write_torch_dist_checkpoint(save_dir, 19)``) or as a command
(``python tests/support/builders/miles/megatron_ckpt.py SAVE_DIR ITER [ITER...] [--seed S] [--no-dataset-state]``). The
Python helpers run the command in a subprocess, so the caller never has a process group, a
multiprocessing manager or megatron-core's import side effects left behind; several iterations in one
call share one subprocess (megatron-core takes seconds to import).

The one departure from a GPU machine, kept as thin as it can be: megatron-core's torch_dist writer calls
``torch.cuda.synchronize()`` after copying tensors to the host and puts a one-element status tensor on
``torch.cuda.current_device()``; a CPU-only torch raises on both. In the writer process only, the first
becomes a no-op (the tensors already are on the host) and the second returns ``"cpu"`` (gloo
broadcasts CPU tensors). The bytes on disk are megatron-core's and torch's, untouched.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
NUM_LAYERS = 2
HIDDEN = 8
VOCAB = 32


def write_torch_dist_checkpoint(save_dir: Path, iteration: int, seed: int = 0, *, dataset_state: bool = True) -> Path:
    """Write one checkpoint (iteration dir, data cursor, then the pointer) and return its iteration dir."""
    return write_torch_dist_checkpoints(save_dir, [iteration], seed, dataset_state=dataset_state)[0]


def write_torch_dist_checkpoints(
    save_dir: Path, iterations: list[int], seed: int = 0, *, dataset_state: bool = True, timeout_s: float = 180.0
) -> list[Path]:
    """Write several checkpoints in one subprocess, in the order given (the pointer ends on the last)."""
    if not iterations:
        raise ValueError("iterations: give at least one iteration to write")
    cmd = [sys.executable, str(HERE), str(save_dir), *map(str, iterations), "--seed", str(seed)]
    if not dataset_state:
        cmd.append("--no-dataset-state")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    from beam_hpc.run.checkpoint_layout import iteration_dir

    return [iteration_dir(save_dir, it) for it in iterations]


def _sharded_state(iteration: int, seed: int, save_dir: Path) -> dict:
    """What Megatron's ``generate_state_dict`` hands to ``dist_checkpointing.save``, in miniature."""
    import random
    from argparse import Namespace

    import numpy as np
    import torch
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    gen = torch.Generator().manual_seed(seed * 100_003 + iteration)

    def layered(key: str, *shape: int) -> list:
        # Megatron stacks per-layer weights into one key with a prepended layer axis.
        return [
            ShardedTensor.from_rank_offsets(key, torch.randn(*shape, generator=gen), (0, layer, NUM_LAYERS),
                                            prepend_axis_num=1)
            for layer in range(NUM_LAYERS)
        ]

    model = {
        "embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
            "embedding.word_embeddings.weight", torch.randn(VOCAB, HIDDEN, generator=gen)),
        "decoder.layers.self_attention.linear_qkv.weight": layered(
            "decoder.layers.self_attention.linear_qkv.weight", 3 * HIDDEN, HIDDEN),
        "decoder.layers.mlp.linear_fc1.weight": layered("decoder.layers.mlp.linear_fc1.weight", 4 * HIDDEN, HIDDEN),
        "decoder.final_layernorm.weight": ShardedTensor.from_rank_offsets(
            "decoder.final_layernorm.weight", torch.ones(HIDDEN)),
    }
    optimizer = {
        "state": {
            moment: ShardedTensor.from_rank_offsets(
                f"optimizer.state.{moment}.embedding.word_embeddings.weight",
                torch.randn(VOCAB, HIDDEN, generator=gen).abs())
            for moment in ("exp_avg", "exp_avg_sq")
        },
        "param_groups": [{"lr": 1e-6, "weight_decay": 0.1, "step": iteration + 1}],
    }
    rng = {
        "random_rng_state": random.Random(seed).getstate(),
        "np_rng_state": np.random.RandomState(seed).get_state()[1],
        "torch_rng_state": torch.Generator().manual_seed(seed).get_state(),
        "cuda_rng_state": None,
    }
    args = Namespace(
        ckpt_format="torch_dist", num_layers=NUM_LAYERS, hidden_size=HIDDEN, padded_vocab_size=VOCAB,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        params_dtype=torch.float32, seed=seed, save=str(save_dir), load=str(save_dir), iteration=iteration,
    )
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        "model": model,
        "optimizer": optimizer,
        "opt_param_scheduler": {"num_steps": iteration + 1, "max_lr": 1e-6, "min_lr": 0.0},
        "rng_state": [ShardedObject("rng_state", rng, (1, 1), (0, 0), replica_id=0)],
    }


def _dataset_state(iteration: int, seed: int) -> dict:
    """Miles's data cursor (``RolloutDataSource.save``): where the next rollout's prompts start."""
    return {"sample_offset": (iteration + 1) * 32, "epoch_id": 0, "sample_group_index": iteration + 1,
            "sample_index": (iteration + 1) * 256, "metadata": {"seed": seed}}


def _save_in_process(save_dir: Path, iterations: list[int], seed: int, dataset_state: bool) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from beam_hpc.run.checkpoint_layout import dataset_state_path, iteration_dir, mark_latest

    # The CPU shims described in the module docstring; this process only.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # A one-rank group on an in-memory store: no port to pick, nothing to clash with other tests.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for it in iterations:
            target = iteration_dir(save_dir, it)
            target.mkdir(parents=True, exist_ok=True)
            dist_checkpointing.save(_sharded_state(it, seed, save_dir), str(target))
            if dataset_state:
                path = dataset_state_path(save_dir, it)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(_dataset_state(it, seed), path)
            mark_latest(save_dir, it)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("save_dir", type=Path, help="Miles's --save directory (created if missing)")
    p.add_argument("iterations", type=int, nargs="+", help="iterations (rollout ids) to write, in order")
    p.add_argument("--seed", type=int, default=0, help="seeds the tensor values, so two runs can differ")
    p.add_argument("--no-dataset-state", action="store_true", help="leave out rollout/global_dataset_state_dict_N.pt")
    a = p.parse_args(argv)
    _save_in_process(a.save_dir, a.iterations, a.seed, not a.no_dataset_state)


if __name__ == "__main__":  # the guard matters: megatron-core's writer starts a spawn-context manager
    main()

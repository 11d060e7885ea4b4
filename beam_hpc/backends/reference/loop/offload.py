"""Where the optimizer state lives between optimizer steps: accelerator, host RAM, or node-local disk.

The seed streams the optimizer state of a 501B model to node-local NVMe (Miles's
``--offload-train-target disk --offload-train-disk-dir``); the reference backend does the same
thing explicitly, so that the runtime's NVMe staging is exercised by a real trainer. ``none``: the
state stays with the parameters; ``cpu``: moved to host RAM after each step and back before the next
(a no-op on a CPU-only machine, but the GPU's code path); ``nvme``: written to files under
``$BEAM_NVME_DIR`` (the job's staged directory) and dropped from memory, read back before the next
step (torch.save/torch.load round-trip fp32 bitwise, so a run's numbers do not change). It is a swap
of its own, not DeepSpeed ZeRO-3's NVMe swapper, which needs ZeRO-3 partitioning, a process group and
a long JIT build that a one-process CPU trainer does not otherwise need. The durable copy is the
checkpoint's ``optimizer.pt``; the NVMe files are scratch, removed by :meth:`OptimizerOffload.close`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beam_hpc.errors import RuntimeFailure
from beam_hpc.files import atomic_path

if TYPE_CHECKING:
    import torch

NVME_ENV = "BEAM_NVME_DIR"
SWAP_SUBDIR = "reference-optimizer-state"


class OffloadError(RuntimeFailure):
    """The offload target cannot be used (e.g. NVMe requested but no staged directory)."""


def nvme_swap_dir() -> Path:
    raw = os.environ.get(NVME_ENV)
    if not raw:
        raise OffloadError(
            f"training.offload.target is 'nvme' but ${NVME_ENV} is not set on this trainer node: the "
            "runtime stages a node-local directory per job and exports it; outside a Slurm job set "
            f"{NVME_ENV}=/some/local/dir or use training.offload.target: cpu"
        )
    root = Path(raw)
    if not root.is_dir():
        raise OffloadError(f"${NVME_ENV}={raw} is not a directory; the runtime should have staged it")
    return root / SWAP_SUBDIR


class OptimizerOffload:
    """Moves a torch optimizer's per-parameter state out after a step and back in before one."""

    def __init__(self, optimizer: torch.optim.Optimizer, target: str, device: str) -> None:
        self.opt = optimizer
        self.target = target
        self.device = device
        self.swap_dir = nvme_swap_dir() if target == "nvme" else None
        if self.swap_dir is not None:
            self.swap_dir.mkdir(parents=True, exist_ok=True)
        self.resident = True

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.opt.param_groups for p in group["params"]]

    def _file(self, index: int) -> Path:
        assert self.swap_dir is not None
        return self.swap_dir / f"param_{index:05d}.pt"

    def bring_in(self) -> None:
        """Make the state resident on the parameters' device (call before ``optimizer.step``)."""
        import torch

        if self.resident:
            return
        for i, p in enumerate(self._params()):
            state = self.opt.state.get(p)
            if not state:
                continue
            if self.target == "nvme":
                state.update(torch.load(self._file(i), map_location=p.device, weights_only=True))
            else:
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state[k] = v.to(p.device)
        self.resident = True

    def send_out(self) -> None:
        """Evict the state to its offload target (call after ``optimizer.step``)."""
        import torch

        if self.target == "none" or not self.resident:
            return
        for i, p in enumerate(self._params()):
            state = self.opt.state.get(p)
            if not state:
                continue
            big = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
            if self.target == "nvme":
                path = self._file(i)
                # node-local scratch, reloaded by this process only: the rename matters, not durability
                with atomic_path(path, durable=False) as tmp:
                    torch.save({k: v.to("cpu") for k, v in big.items()}, tmp)
                for k in big:
                    del state[k]  # the disk copy is now the only one
            else:
                for k, v in big.items():
                    state[k] = v.to("cpu")
        self.resident = False

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state (for the checkpoint), leaving the offload as it was."""
        was_out = not self.resident
        self.bring_in()
        sd = self.opt.state_dict()
        if self.target == "nvme":
            import copy

            sd = copy.deepcopy(sd)  # send_out drops tensors the dict still references
        if was_out:
            self.send_out()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.resident = True
        self.opt.load_state_dict(sd)
        self.send_out()

    def disk_usage(self) -> tuple[int, int]:
        """(files, bytes) of swapped state on disk now; (0, 0) unless the target is nvme."""
        if self.swap_dir is None or not self.swap_dir.is_dir():
            return 0, 0
        files = [f for f in self.swap_dir.iterdir() if f.suffix == ".pt"]
        return len(files), sum(f.stat().st_size for f in files)

    def close(self) -> None:
        """Remove the scratch copy: after a run nothing of it may stay on the node."""
        if self.swap_dir is not None and self.swap_dir.exists():
            shutil.rmtree(self.swap_dir)

"""One segment's RL loop (``driver.Loop``) and the trainer side of it: the trainer actor, the GRPO/DAPO
algorithm, the optimizer and its NVMe offload, checkpoints, metrics and the prompt order. It uses
``rollouts`` to get rollouts computed and ``model`` to load the policy; nothing below imports it."""

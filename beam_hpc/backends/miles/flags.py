"""The Miles flags beam-hpc sets, each with the recipe or site field it comes from.

One table, owned here, read by two modules: the argument builder (``args``) refuses to emit a flag
missing from it, and the checks (``checks``) refuse pass-through flags that repeat one (the user
must change the field instead). Keeping it apart from both is what lets the checks run without
importing the builder. The tests check every name against Miles's own parser
(``tests/support/fixtures/miles-megatron-flags.txt``).
"""

from __future__ import annotations

# Every flag the builder may emit -> the recipe/site field it comes from. The builder refuses a
# flag missing here, the checks refuse pass-through flags that repeat one, and the tests check
# each name against Miles's parser.
SOURCES: dict[str, str] = {
    # topology
    "--actor-num-nodes": "topology.trainer.nodes",
    "--actor-num-gpus-per-node": "topology.trainer.gpus_per_node",
    "--rollout-num-gpus": "topology.rollout.nodes x gpus_per_node",
    "--rollout-num-gpus-per-engine": "topology.rollout.gpus_per_engine",
    "--num-gpus-per-node": "topology.<rollout or trainer>.gpus_per_node",
    "--colocate": "training.colocated",
    # model and starting weights
    "--hf-checkpoint": "model.path",
    "--ref-load": "model.ref_load",
    "--tensor-model-parallel-size": "model.tensor_parallel",
    "--pipeline-model-parallel-size": "model.pipeline_parallel",
    "--context-parallel-size": "model.context_parallel",
    "--expert-model-parallel-size": "model.expert_parallel",
    "--expert-tensor-parallel-size": "model.expert_tensor_parallel",
    "--sequence-parallel": "model.tensor_parallel > 1 (Megatron: EP with TP needs it)",
    "--seed": "seed",
    "--rollout-seed": "seed",
    # data
    "--prompt-data": "data.dir + data.train",
    "--input-key": "(Miles JSONL written by beam-hpc prepare)",
    "--label-key": "(Miles JSONL written by beam-hpc prepare)",
    "--apply-chat-template": "(chat-message prompts)",
    "--rollout-shuffle": "data.shuffle",
    # batch and lengths
    "--num-rollout": "num_rollout",
    "--rollout-batch-size": "batch.prompts",
    "--n-samples-per-prompt": "batch.responses_per_prompt",
    "--global-batch-size": "batch (prompts x responses / updates_per_rollout)",
    "--rollout-max-prompt-len": "tokens.max_prompt",
    "--rollout-max-response-len": "tokens.max_response",
    "--rollout-temperature": "training.temperature",
    # reward
    "--custom-rm-path": "reward (beam_hpc.reward.scoring)",
    "--reward-key": "reward",
    "--eval-reward-key": "reward / eval",
    "--log-reward-category": "eval (Miles's own answer checking, beside beam-hpc's)",
    # evaluation
    "--eval-interval": "eval.interval",
    "--eval-prompt-data": "data.eval_name + data.eval",
    "--n-samples-per-eval-prompt": "eval.samples_per_prompt",
    "--eval-max-prompt-len": "tokens.max_prompt",
    "--eval-max-response-len": "eval.max_response (default tokens.max_response)",
    "--eval-temperature": "eval.temperature",
    "--eval-top-p": "eval.top_p",
    # loss
    "--advantage-estimator": "training.advantage_estimator",
    "--eps-clip": "training.eps_clip",
    "--eps-clip-high": "training.eps_clip_high",
    "--calculate-per-token-loss": "training.per_token_loss",
    "--use-kl-loss": "training.kl_coef",
    "--kl-loss-coef": "training.kl_coef",
    "--kl-loss-type": "training.kl_coef",
    # optimizer
    "--optimizer": "(Adam, as the seed)",
    "--use-distributed-optimizer": "(needed by NVMe streaming)",
    "--lr": "training.optimizer.lr",
    "--lr-decay-style": "(constant, as DAPO)",
    "--lr-warmup-iters": "training.optimizer.warmup_rollouts",
    "--weight-decay": "training.optimizer.weight_decay",
    "--adam-beta1": "training.optimizer.adam_beta1",
    "--adam-beta2": "training.optimizer.adam_beta2",
    "--clip-grad": "training.optimizer.grad_clip",
    # numerics and performance: Miles's launchers' practice (radixark/miles 31f1ca96)
    "--attention-dropout": "training.dropout",
    "--hidden-dropout": "training.dropout",
    "--accumulate-allreduce-grads-in-fp32": "training.fp32_grad_allreduce",
    "--attention-softmax-in-fp32": "training.fp32_softmax",
    "--attention-backend": "performance.attention_backend",
    "--recompute-granularity": "performance.recompute",
    "--recompute-method": "performance.recompute_method",
    "--recompute-num-layers": "performance.recompute_num_layers",
    "--use-dynamic-batch-size": "performance.dynamic_batch_size",
    "--max-tokens-per-gpu": "performance.max_tokens_per_gpu (default: 2 x (tokens.max_prompt + tokens.max_response) / model.context_parallel)",
    "--sglang-mem-fraction-static": "performance.sglang_mem_fraction",
    "--balance-data": "performance.balance_data",
    # optimizer state placement
    "--offload-train-target": "training.offload.target",
    "--stream-optimizer-state-to-disk": "training.offload.target",
    "--offload-train-disk-dir": "training.offload.nvme_dir (staged per job)",
    "--optimizer-cpu-offload": "training.offload.target",
    "--overlap-cpu-optimizer-d2h-h2d": "training.offload.target",
    "--use-precision-aware-optimizer": "training.offload.target",
    # LoRA
    "--lora-rank": "training.lora.rank",
    "--lora-alpha": "training.lora.alpha",
    "--lora-dropout": "training.lora.dropout",
    "--target-modules": "training.lora.target_modules",
    "--megatron-to-hf-mode": "training.mode",
    # checkpoints, dumps, logs
    "--save": "output_dir (pinned: <output>/checkpoints)",
    "--load": "output_dir (pinned: <output>/checkpoints)",
    "--save-interval": "checkpoint.interval",
    "--save-trigger-sentinel": "lifecycle.save_on_request (<output>/SAVE_NOW)",
    "--dump-details": "output_dir (<output>/dumps)",
    "--use-tensorboard": "output_dir (<output>/tensorboard)",
    "--use-fault-tolerance": "(rollout engine health checks)",
    # Weights & Biases (one run per beam-hpc run: beam_hpc.run.tracking)
    "--use-wandb": "tracking.wandb",
    "--wandb-project": "tracking.wandb.project",
    "--wandb-team": "tracking.wandb.entity (Miles's entity flag)",
    "--wandb-group": "name (the run's name, also its W&B run name)",
    "--disable-wandb-random-suffix": "tracking.wandb (one run per chain: no per-segment suffix)",
    "--wandb-dir": "output_dir (<output>/wandb)",
    "--wandb-mode": "tracking.wandb.mode, offline where site.compute_internet is false",
}


# What a user who asks Miles for engines it did not launch is told: no Miles run can take them today
# (Miles main 31f1ca96 gives them no GPUs: placement_group.py:97-99, then server_group.py:90-91).
_NO_ATTACHED_ENGINES = ("leave it out: Miles starts no engine it did not launch itself (radixark/miles 31f1ca96 "
                        "placement_group.py:97-99, server_group.py:90-91), and `beam-hpc rollout add` adds no engines to a Miles run "
                        "for that reason; for more rollout capacity raise topology.rollout.nodes and resubmit")


# Flags beam-hpc never emits but owns all the same: the lifecycle, checkpoints, topology and data
# depend on Miles *not* getting them, so ``backend_options.extra_args`` refuses them (exit 2),
# naming what to use instead.
OWNED_NOT_EMITTED: dict[str, str] = {
    "--start-rollout-id": "set num_rollout instead: a resumed segment continues from the checkpoint's own cursor",
    "--ckpt-step": "leave it out: every segment resumes from the latest checkpoint in <output>/checkpoints",
    "--no-load-optim": "leave it out: a resumed segment must restore the optimizer state",
    "--no-load-rng": "leave it out: a resumed segment must restore the RNG state",
    "--finetune": "set model.ref_load instead: --finetune would restart every segment at rollout 0",
    "--ckpt-format": "leave it out: beam-hpc's resume checks read Miles's torch_dist checkpoints",
    "--exit-duration-in-mins": "set lifecycle.walltime instead: the lifecycle saves and stops before it",
    "--exit-interval": "set num_rollout instead",
    "--exit-signal-handler": "set lifecycle.save_on_request instead (the lifecycle's save-now sentinel)",
    "--train-iters": "set num_rollout instead",
    "--num-epoch": "set num_rollout instead (total rollouts, including those already done)",
    "--offload": "set training.offload.target or training.colocated instead",
    "--offload-train": "set training.colocated (--colocate turns it on) or training.offload.target instead",
    "--critic-num-nodes": "leave it out: beam-hpc's topology places no critic group",
    "--critic-num-gpus-per-node": "leave it out: beam-hpc's topology places no critic group",
    "--wandb-run-id": "leave it out: every segment logs to the run's one W&B run (<output>/wandb/run_id)",
    # --use-fault-tolerance alone means "rollout" (radixark/miles 31f1ca96 arguments.py:2793-2801): the
    # engine health checks and in-place restarts a segment relies on to go on after an engine dies;
    # a list without "rollout" turns them off (rollout_manager.py:115), and "train" switches Miles
    # to independent data-parallel replicas with local non-persistent checkpoints (arguments.py:2856-2870)
    "--ft-components": ("leave it out: beam-hpc runs Miles with --use-fault-tolerance, whose default (rollout) "
                        "restarts a dead SGLang engine in place; other lists turn that off or switch Miles to "
                        "its independent-DP trainer mode, which beam-hpc's segments do not resume"),
    # reserved for attaching extra jobs' engines at segment start, which no Miles run does today: Miles
    # main gives attached engines no GPUs (backends.miles.external_engines.refusal; rollout add exits 2)
    "--rollout-external": _NO_ATTACHED_ENGINES,
    "--rollout-external-engine-addrs": _NO_ATTACHED_ENGINES,
    "--worker-urls": _NO_ATTACHED_ENGINES,
}
# Flags that Miles's own model scripts may also set (the MLA scripts set --attention-softmax-in-fp32,
# some set dropout 0): the architecture flags may repeat them with the recipe's value, and beam-hpc
# then leaves its own copy out (``architecture.reconcile``); a different value is refused.
ALSO_IN_MODEL_SCRIPTS = ("--attention-dropout", "--hidden-dropout", "--attention-softmax-in-fp32")


def managed_flags() -> dict[str, str]:
    """Flags beam-hpc sets or owns -> what to do instead (one phrase each, for the refusal)."""
    return {**{f: f"remove it and set {field} instead" for f, field in SOURCES.items()}, **OWNED_NOT_EMITTED}

"""Make Miles's training bundles land on trainer-group nodes, prove it, and never wait forever.

Why: Miles (radixark/miles@31f1ca961, ``miles/ray/placement_group.py``) reserves one PACK placement
group of ``{"GPU": 1, "CPU": 1}`` bundles, sorts them by (node IP, GPU id) and gives the first
``actor_num_nodes x actor_num_gpus_per_node`` to training: on a heterogeneous job the trainer would
land on whichever nodes have the lowest IPs. Measured on a 3-node Ray cluster: unpatched, training
went to the wrong nodes every time; re-keying the sort alone still failed in 34 of 40 trials
whenever GPUs were spare (PACK may leave a trainer GPU empty and fill a rollout node); a hard
per-bundle pin by node label was right in every trial. So, in the driver process and before Miles
creates its placement group (no Miles file is edited), :class:`PlacementPatch` replaces three
module globals Miles looks up at call time: the layout, ``placement_group`` (a label pin, with a
feasibility check and a bounded wait) and the sort key (trainer nodes first); the resulting layout
is checked and reported as the proof. Needs Ray's ``bundle_label_selector`` (verified on 2.60).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from beam_hpc.errors import RuntimeFailure
from beam_hpc.plan.ray_labels import GROUP_LABEL_KEY

logger = logging.getLogger(__name__)

TRAINER = "trainer"
DEFAULT_TIMEOUT_S = 120.0


class PlacementError(RuntimeFailure):
    """The trainer/rollout split cannot be placed, or was placed wrongly."""


@dataclass(frozen=True)
class BundlePlace:
    """Where one bundle of Miles's placement group landed, in Miles's (sorted) order."""

    bundle: int
    node: str
    gpu: Any
    trainer_node: bool


@dataclass(frozen=True)
class PlacementLayout:
    """The proof: Miles's sorted bundle order, the first ``train_bundles`` being training's."""

    train_bundles: int
    places: tuple[BundlePlace, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "train_bundles": self.train_bundles,
            "bundles": [
                {"order": i, "bundle": p.bundle, "node": p.node, "gpu": p.gpu,
                 "role": "train" if i < self.train_bundles else "rollout",
                 "node_group": TRAINER if p.trainer_node else "other"}
                for i, p in enumerate(self.places)
            ],
        }


def is_trainer_node(node: Mapping[str, Any], label_key: str = GROUP_LABEL_KEY, trainer: str = TRAINER) -> bool:
    """A ``ray.nodes()`` entry is a trainer node when its group label says so."""
    return (node.get("Labels") or {}).get(label_key) == trainer


def bundle_capacity(resources: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of ``bundle`` fit in a node's total ``resources``."""
    fits = [math.floor(resources.get(name, 0.0) / need + 1e-9) for name, need in bundle.items() if need > 0]
    return min(fits) if fits else 0


def check_feasible(
    nodes: Sequence[Mapping[str, Any]],
    bundles: Sequence[Mapping[str, float]],
    train_bundles: int,
    label_key: str = GROUP_LABEL_KEY,
    trainer: str = TRAINER,
) -> None:
    """Raise PlacementError when the live nodes cannot ever hold the request.

    ``nodes`` are ``ray.nodes()`` entries. With ``train_bundles`` > 0 the first ``train_bundles``
    bundles must fit on trainer nodes and the rest on the others (the pin); otherwise all of
    them anywhere. Only total capacity is known here; what other work holds right now is what
    the bounded wait catches.
    """
    if not bundles:
        return
    if any(dict(b) != dict(bundles[0]) for b in bundles):
        return  # Miles's bundles are uniform; anything else is left to the bounded wait
    alive = [n for n in nodes if n.get("Alive", True)]
    caps = {str(n.get("NodeManagerAddress")): bundle_capacity(n.get("Resources") or {}, bundles[0]) for n in alive}
    train_nodes = {str(n.get("NodeManagerAddress")) for n in alive if is_trainer_node(n, label_key, trainer)}
    what = ", ".join(f"{k}: {v:g}" for k, v in bundles[0].items())

    def where(ips: set[str]) -> str:
        return ", ".join(f"{ip} x{caps[ip]}" for ip in sorted(ips)) or "none"

    if train_bundles <= 0:
        have = sum(caps.values())
        if have < len(bundles):
            raise PlacementError(
                f"Miles asks for {len(bundles)} bundles of {{{what}}} but the cluster's live nodes hold only "
                f"{have} ({where(set(caps))}); make the job's GPU count match the recipe's topology"
            )
        return
    other_nodes = set(caps) - train_nodes
    have_train = sum(caps[ip] for ip in train_nodes)
    have_other = sum(caps[ip] for ip in other_nodes)
    need_other = len(bundles) - train_bundles
    if have_train < train_bundles or have_other < need_other:
        raise PlacementError(
            f"Miles asks for {train_bundles} training bundles of {{{what}}} on nodes labelled "
            f"{label_key}={trainer} (they hold {have_train}: {where(train_nodes)}) and {need_other} rollout "
            f"bundles on the other nodes (they hold {have_other}: {where(other_nodes)}). Size the groups "
            "exactly: --actor-num-nodes x --actor-num-gpus-per-node = trainer nodes x their GPUs, "
            "--rollout-num-gpus = the rollout group's GPUs, and every node started with its group label"
        )


LEGACY_LAYOUT = "create_placement_groups"


def legacy_rollout_offset(args: Any) -> int:
    """Leading training bundles as miles-rl 0.0.2's ``create_placement_groups`` computes them: none
    in debug and colocated modes, else the actor's GPUs (plus the critic's)."""
    if getattr(args, "debug_train_only", False) or getattr(args, "debug_rollout_only", False) or args.colocate:
        return 0
    offset = args.actor_num_nodes * args.actor_num_gpus_per_node
    if getattr(args, "use_critic", False):
        offset += args.critic_num_nodes * args.critic_num_gpus_per_node
    return offset


class PlacementPatch:
    """The three replaced globals of one ``miles.ray.placement_group`` module, and their state.

    ``_create_placement_group`` looks them up at call time, so it does not matter that ``train.py``
    imported ``create_placement_groups`` by name earlier:

    - ``_get_placement_group_layout``: wrapped to record how many leading bundles are training's
      (its ``rollout_offset``; 0 for colocated and debug modes, where nothing is pinned); older Miles
      (miles-rl 0.0.2) computes the split inline, so there ``create_placement_groups`` is wrapped
      instead and the split computed the same way (:func:`legacy_rollout_offset`);
    - ``placement_group``: wrapped to pass ``bundle_label_selector`` (the first ``n_train`` bundles on
      ``beam-group=trainer`` nodes, the others on ``!trainer`` nodes), after a feasibility check
      against the cluster's nodes and with a bounded wait: an impossible request would otherwise
      leave Miles blocked for ever in ``ray.get(pg.ready())``;
    - ``sort_key``: ``(0 if trainer node else 1, Miles's own key)``, so the (IP, GPU) order inside
      each group stays Miles's (its rollout engines rely on ascending GPU ids). Once every bundle
      is keyed, the layout is checked and reported to ``on_layout`` (the launcher writes it)."""

    def __init__(
        self,
        module: ModuleType,
        *,
        label_key: str = GROUP_LABEL_KEY,
        trainer: str = TRAINER,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pin: bool = True,
        on_layout: Callable[[PlacementLayout], None] | None = None,
        nodes: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.module = module
        self._nodes = nodes  # ray.nodes() unless given (tests of the selectors without a cluster)
        self.label_key, self.trainer = label_key, trainer
        self.timeout_s, self.pin, self.on_layout = timeout_s, pin, on_layout
        self._orig: dict[str, Any] = {}
        self._roles: dict[str, bool] = {}
        self._train_bundles = 0
        self._expected = 0
        self._keyed: list[tuple[Any, ...]] = []
        self.layouts: list[PlacementLayout] = []  # every layout placed through this patch

    # -- install / remove ------------------------------------------------------------------
    def apply(self) -> PlacementPatch:
        # Where the training/rollout split is computed: Miles main has _get_placement_group_layout;
        # older Miles (miles-rl 0.0.2) computes it inline in create_placement_groups, which the
        # entry point imports by name only after the launcher has patched it.
        layout = "_get_placement_group_layout"
        if not callable(getattr(self.module, layout, None)) and callable(getattr(self.module, LEGACY_LAYOUT, None)):
            layout = LEGACY_LAYOUT
        names = ("sort_key", layout, "placement_group")
        missing = [n for n in names if not callable(getattr(self.module, n, None))]
        if missing:
            raise PlacementError(
                f"{self.module.__name__} has no {', '.join(missing)}: this Miles version places bundles "
                "differently; check miles/ray/placement_group.py against beam_hpc.backends.miles.placement"
            )
        if self._orig:
            raise PlacementError(f"{self.module.__name__} is already patched by this object")
        self._orig = {n: getattr(self.module, n) for n in names}
        self.module.sort_key = self._sort_key
        setattr(self.module, layout, self._layout if layout != LEGACY_LAYOUT else self._legacy_create)
        self.module.placement_group = self._placement_group
        return self

    def restore(self) -> None:
        for name, fn in self._orig.items():
            setattr(self.module, name, fn)
        self._orig = {}

    # -- the wrappers ------------------------------------------------------------------------
    def _layout(self, args: Any) -> tuple[int, int]:
        num, offset = self._orig["_get_placement_group_layout"](args)
        self._train_bundles = offset
        return num, offset

    def _legacy_create(self, args: Any) -> Any:
        """Older Miles's ``create_placement_groups``: the same split, computed here from ``args``
        as that version does inline (training first, then critic, then rollout)."""
        self._train_bundles = legacy_rollout_offset(args)
        return self._orig[LEGACY_LAYOUT](args)

    def _placement_group(self, bundles: list[dict[str, float]], strategy: str | None = None, **kwargs: Any) -> Any:
        n_train = self._train_bundles if self.pin else 0
        check_feasible(self._live_nodes(), bundles, n_train, self.label_key, self.trainer)
        if n_train:
            kwargs["bundle_label_selector"] = [
                {self.label_key: self.trainer if i < n_train else "!" + self.trainer} for i in range(len(bundles))
            ]
        pg = self._orig["placement_group"](bundles, strategy=strategy, **kwargs)
        if not pg.wait(self.timeout_s):
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
            raise PlacementError(
                f"placement group of {len(bundles)} bundles ({n_train} pinned to {self.label_key}={self.trainer}) "
                f"was not ready after {self.timeout_s:g} s although the nodes could hold it: GPUs or CPUs are held "
                "by other work on this Ray cluster, or a node died; removed it instead of letting Miles wait for ever"
            )
        self._expected, self._keyed = len(bundles), []
        return pg

    def _sort_key(self, info: tuple[int, str, Any]) -> tuple[int, Any]:
        index, node, gpu = info
        trainer_node = self._role(node)
        self._keyed.append((index, node, gpu, trainer_node))
        if self._expected and len(self._keyed) == self._expected:
            self._finish_layout()
        return (0 if trainer_node else 1, self._orig["sort_key"](info))

    # -- helpers -----------------------------------------------------------------------------
    def _live_nodes(self) -> list[dict[str, Any]]:
        if self._nodes is not None:
            return [n for n in self._nodes() if n.get("Alive", True)]
        import ray

        return [n for n in ray.nodes() if n.get("Alive")]

    def _role(self, node: str) -> bool:
        if node not in self._roles:
            self._roles.update(
                {str(n["NodeManagerAddress"]): is_trainer_node(n, self.label_key, self.trainer)
                 for n in self._live_nodes()}
            )
        if node not in self._roles:
            raise PlacementError(f"bundle on {node!r}, which is not a live node of this Ray cluster")
        return self._roles[node]

    def _finish_layout(self) -> None:
        """All bundles keyed: compute Miles's order, check the split, report it."""
        orig = self._orig["sort_key"]
        ordered = sorted(self._keyed, key=lambda k: (0 if k[3] else 1, orig(k[:3])))
        layout = PlacementLayout(
            train_bundles=self._train_bundles,
            places=tuple(BundlePlace(bundle=i, node=n, gpu=g, trainer_node=t) for i, n, g, t in ordered),
        )
        self._expected, self._keyed = 0, []
        self.layouts.append(layout)
        if self.pin and layout.train_bundles:
            wrong = [p for i, p in enumerate(layout.places) if p.trainer_node != (i < layout.train_bundles)]
            if wrong:
                raise PlacementError(
                    f"training/rollout split is wrong after placement: {len(wrong)} bundles on the other group's "
                    f"nodes ({', '.join(f'{p.node} gpu {p.gpu}' for p in wrong[:6])}); is every node labelled "
                    f"{self.label_key}=<group>, and does this Ray honour bundle_label_selector?"
                )
        logger.info(
            "placement: %d training bundles on %s; rollout on %s", layout.train_bundles,
            sorted({p.node for p in layout.places[: layout.train_bundles]}),
            sorted({p.node for p in layout.places[layout.train_bundles:]}),
        )
        if self.on_layout is not None:
            self.on_layout(layout)


def apply_placement_patch(module: ModuleType, **options: Any) -> PlacementPatch:
    """Patch ``module`` (Miles's ``miles.ray.placement_group``) in place; returns the patch.

    ``options`` are :class:`PlacementPatch`'s: ``pin=False`` keeps only the re-keyed sort (for
    measurement, never for real runs); ``nodes`` replaces ``ray.nodes()`` (tests without a cluster).
    """
    return PlacementPatch(module, **options).apply()

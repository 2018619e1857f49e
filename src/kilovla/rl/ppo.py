"""PPO (`learner.algo.name=ppo`): the VLA itself and a value head, trained on-policy (decoupled PPO, or AWR);
the learner takes segments in and makes one optimizer step per global batch (no Ray here; workers.py wraps it).

Per segment, GAE over its T steps with the behaviour values stored at rollout and the current
critic's value of the observation after it (the bootstrap). An episode cut by `max_steps` is not
terminated: GAE bootstraps through the cut with the stored value of the last observation the policy
acted on before it (the env resets right after the cut, so the observation it was cut in is gone;
V of the chunk's starting state stands in for it).

Advantages are divided by a running RMS of past global batches' advantages (no mean subtraction:
a uniformly good batch stays positive). The scale changes only when the optimizer steps, from the
completed global batch's advantages (summed over learner ranks), so every micro-batch of a global
batch sees the same scale whatever order and grouping its segments arrive in: async (often one
segment per `consume`) and sync train the same. The first global batch uses scale 1. Samples are trained in micro-batches as
segments arrive (`StreamingStep`): the loss of a micro-batch is the sum of decoupled-PPO and value
losses over its samples, scaled by 1 / (samples in a global batch); the optimizer steps when the
global batch (B segments x T steps, spread over the learner ranks) is complete. The proximal policy
of the decoupled loss is the learner's policy as it consumes the sample: with no staleness it is the
behaviour policy and the loss is plain PPO. With `policy_loss` "awr" the policy term is instead
advantage-weighted regression: each sample's flow-matching error on the chunk it executed, weighted by
min(exp(A / awr_temperature), awr_max_weight) (A divided by the running RMS as above), its flow time
and noise drawn from a seed of the sample's identity (`flow_seeds`), so that loss too is independent
of the split. With `kl_coef` > 0 each sample also pays kl_coef x the KL of
its stochastic transitions from the frozen policy the run began with (a second, gradient-free forward).

The optimizer, its schedule and gradient clipping are the supervised trainer's (`train.optim`),
with the value head in its own parameter group; freezing is the trainer's `apply_freeze`; on
several ranks the model is wrapped by the trainer's `distributed.parallelize` (DDP) and only the
micro-batch that completes a global batch reduces gradients (`distributed.gradient_sync`).

With calibrated compute (`compute.ComputeSection`, throughput benchmarks only) the model's
arithmetic is replaced by sleeps of the measured times: the bootstrap value is the stored value of
the segment's last step, each micro-batch sleeps instead of forward + backward, the optimizer step
sleeps; the data handling, GAE, advantage scale, `StreamingStep`'s once-per-global-batch step and the
version bump stay as they are.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kilovla.errors import KilovlaError
from kilovla.policy_folder import POLICY_JSON
from kilovla.rl.algorithm import Algorithm, LearnerRun, Run, RunConfig
from kilovla.rl.compute import ComputeSection, sleep_until
from kilovla.rl.core import trajectory
from kilovla.rl.core.losses import awr_loss, decoupled_ppo_loss, gae, value_loss
from kilovla.rl.core.streaming import StreamingStep
from kilovla.rl.policy import ActorCritic, critic_width, frozen_policy, load_actor_critic, stale_value_head
from kilovla.train import distributed
from kilovla.train.optim import build_optimizer
from kilovla.train.build import apply_freeze

if TYPE_CHECKING:
    from kilovla.policy_folder import PolicyFolder

log = logging.getLogger(__name__)


def flow_seeds(segment: trajectory.Segment) -> np.ndarray:
    """A seed (T,) per step of a segment from its identity: the flow time and noise of its AWR loss."""
    return np.array([np.random.SeedSequence([*segment.segment_id, k]).generate_state(1, np.uint32)[0]
                     for k in range(len(segment))], np.int64)


class AdvantageScale:
    """Running RMS of advantages, updated once per global batch: what every sample's advantage is divided by."""

    def __init__(self, momentum: float = 0.9):
        self.momentum = momentum
        self.mean_square, self.updates = 0.0, 0
        self._sum, self._count = 0.0, 0  # the global batch in progress

    @property
    def scale(self) -> float:
        if self.updates == 0:
            return 1.0
        return max(1e-8, (self.mean_square / (1.0 - self.momentum ** self.updates)) ** 0.5)

    def observe(self, advantages: np.ndarray) -> None:
        self._sum += float(np.square(advantages, dtype=np.float64).sum())
        self._count += len(advantages)

    def step(self, world: distributed.World | None = None) -> None:
        """The global batch is complete: fold its mean square (over all ranks) into the running one."""
        total = torch.tensor([self._sum, float(self._count)], dtype=torch.float64)
        if world is not None and world.size > 1:
            import torch.distributed as dist

            dist.all_reduce(total)
        self._sum, self._count = 0.0, 0
        if total[1] == 0:
            return
        self.mean_square = self.momentum * self.mean_square + (1.0 - self.momentum) * float(total[0] / total[1])
        self.updates += 1

    def state_dict(self) -> dict:
        return {"mean_square": self.mean_square, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.mean_square, self.updates = float(state["mean_square"]), int(state["updates"])


class Learner:
    """PPO's learner; `cfg` is the run's learner.algo, whose own fields are PPO's settings."""

    def __init__(self, model: ActorCritic, cfg, segments_per_step: int, segment_steps: int,
                 total_steps: int, world: distributed.World | None = None, compute: ComputeSection | None = None,
                 reference: torch.nn.Module | None = None):
        self.cfg, self.world, self.reference = cfg, world or distributed.World(), reference
        self.compute = compute if compute is not None and compute.calibrated else None
        self.model = model
        apply_freeze(model.vla, freeze_vision=cfg.freeze_vision, freeze_vlm=cfg.freeze_vlm)
        self.step_model = distributed.parallelize(model, "ddp", self.world)
        self.trainable, self.optimizer, self.scheduler = build_optimizer(
            model, cfg.optim, total_steps, extra_groups=[{"params": list(model.value_head.parameters()), "lr": cfg.value_lr}])
        per_rank = segments_per_step * segment_steps // self.world.size
        self.stream = StreamingStep(self.optimizer, per_rank, self.trainable, cfg.optim.clip_grad_norm, self.scheduler)
        self.version = 0
        self.adv_scale = AdvantageScale(cfg.advantage_rms_momentum)
        self._stats: list[dict] = []
        self._ev = torch.zeros(5, dtype=torch.float64)  # n, sum and sum of squares of returns and of return - V
        self._no_loss = torch.zeros((), requires_grad=True)  # calibrated compute: a backward that touches no weight

    def advantages(self, segment: trajectory.Segment) -> tuple[np.ndarray, np.ndarray]:
        """GAE over a segment: (advantages, returns), bootstrapped with the current critic after the segment
        and with the stored value of the last acted-on observation at a truncation."""
        if segment.done[-1]:
            last = 0.0
        elif self.compute is not None:
            t0 = time.monotonic()
            last = float(segment.value[-1])
            sleep_until(t0, self.compute.learn_bootstrap_s)
        else:
            last = float(self.model.value(trajectory.stack([segment.next_obs]))[0])
        truncated = segment.truncated if segment.truncated is not None else np.zeros(len(segment), bool)
        value = torch.tensor(segment.value)
        adv, ret = gae(torch.tensor(segment.reward, dtype=torch.float32), value, torch.tensor(segment.done),
                       torch.tensor(last), self.cfg.gamma, self.cfg.lam, torch.tensor(truncated), value)
        return adv.numpy(), ret.numpy()

    def consume(self, segments: list[trajectory.Segment]) -> dict | None:
        """Train on these segments; returns the step's statistics when they completed a global batch."""
        adv, ret = zip(*(self.advantages(s) for s in segments))
        data = {"obs": trajectory.concat([s.obs for s in segments]),
                "chain": np.concatenate([s.chain for s in segments]),
                "stochastic": np.concatenate([s.stochastic for s in segments]),
                "logp": np.concatenate([s.logp for s in segments]), "value": np.concatenate([s.value for s in segments]),
                "adv": np.concatenate(adv), "ret": np.concatenate(ret),
                "seed": np.concatenate([flow_seeds(s) for s in segments])}
        n = len(data["adv"])
        self.adv_scale.observe(data["adv"])
        scale = self.adv_scale.scale if self.cfg.normalize_advantages else 1.0  # fixed within a global batch
        stepped = None
        for start in range(0, n, self.cfg.micro_batch):
            rows = np.arange(start, min(n, start + self.cfg.micro_batch))
            if self.compute is not None:
                out, stats = self._calibrated_backward(len(rows))
            else:
                with distributed.gradient_sync(self.step_model, sync=self.stream.completes(len(rows))):
                    loss, stats = self._loss(data, rows, scale)
                    out = self.stream.backward(loss, len(rows))
            self._stats.append(stats)
            if out is not None:
                stepped = self._finish_step(out)
        return stepped

    def _loss(self, data: dict, rows: np.ndarray, scale: float) -> tuple[torch.Tensor, dict]:
        t = lambda k, dtype=torch.float32: torch.as_tensor(data[k][rows], dtype=dtype)  # noqa: E731
        awr = self.cfg.policy_loss == "awr"
        score, values, kl = self.step_model(trajectory.index(data["obs"], rows), t("chain"), t("stochastic", torch.bool),
                                            self.reference, objective="flow" if awr else "logp", seeds=t("seed", torch.int64))
        behav, adv = t("logp"), t("adv") / scale
        if awr:
            policy, stats = awr_loss(score, adv, self.cfg.awr_temperature, self.cfg.awr_max_weight)
            stats["flow_error"] = score.detach().mean().item()
        else:
            policy, stats = decoupled_ppo_loss(score, score.detach(), behav, adv, self.cfg.clip, self.cfg.behav_cap)
            gap = score.detach() - behav
            stats["logp_gap"] = gap.abs().mean().item()
            stats["log_ratio_std"] = gap.std().item() if len(gap) > 1 else 0.0
        critic = value_loss(values, t("ret"), t("value"), self.cfg.value_clip)
        ret, residual = t("ret").double(), (t("ret") - values.detach()).double()
        self._ev += torch.stack([torch.tensor(float(len(rows)), dtype=torch.float64), ret.sum(), (ret ** 2).sum(),
                                 residual.sum(), (residual ** 2).sum()])
        loss = policy + self.cfg.value_coef * critic
        if kl is not None:
            loss = loss + self.cfg.kl_coef * kl
            stats["kl_to_start"] = kl.mean().item()
        stats.update(policy_loss=policy.mean().item(), value_loss=critic.mean().item(), advantage=t("adv").mean().item())
        return loss.sum(), stats

    def _calibrated_backward(self, n: int) -> tuple[dict | None, dict]:
        """A micro-batch of n samples with the model's compute as sleeps: the stream still counts the samples
        and steps the optimizer (on no gradients: the weights stay) when the global batch is complete."""
        t0 = time.monotonic()
        seconds = self.compute.learn_s(n) + (self.compute.learn_step_s if self.stream.completes(n) else 0.0)
        sleep_until(t0, seconds)
        return self.stream.backward(self._no_loss, n), {"compute_sleep_s": seconds}

    def _finish_step(self, out: dict) -> dict:
        self.version += 1
        self.adv_scale.step(self.world)
        stats = {k: float((np.max if k.endswith("_max") else np.mean)([s[k] for s in self._stats])) for k in self._stats[0]}
        self._stats = []
        n, sr, sr2, se, se2 = self._ev.tolist()
        self._ev.zero_()
        if n > 1:  # the critic's explained variance over the global batch: 1 - Var(R - V) / Var(R)
            var_r, var_e = sr2 / n - (sr / n) ** 2, se2 / n - (se / n) ** 2
            stats["explained_variance"] = 1.0 - var_e / var_r if var_r > 1e-12 else 0.0
        return {"version": self.version, "grad_norm": out["grad_norm"], "lr": self.scheduler.get_last_lr()[0],
                "advantage_scale": self.adv_scale.scale, **stats}

    def weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the acting weights (the VLA and the value head) for the inference servers."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        return {"model": self.weights(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "version": self.version,
                "advantage_scale": self.adv_scale.state_dict(), "algorithm": "ppo"}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        if "advantage_scale" in state:
            self.adv_scale.load_state_dict(state["advantage_scale"])


class PPO(Algorithm):
    """The on-policy learner of the VLA (`Learner` above); it acts with Flow-SDE chains (rl/policy.py)."""

    name = "ppo"
    checkpoint_files = ("model.safetensors", "value_head.safetensors")

    def check_config(self, cfg: RunConfig) -> None:
        """PPO's settings are `learner.algo`'s own fields, which rl/checks.py checks whichever algorithm runs."""

    def fit_start(self, cfg: Run, source: PolicyFolder, n_action_steps: int, folder: Path | None,
                  state: dict) -> Run:
        """A KL penalty needs the policy the run began with; a value head must fit this critic."""
        if cfg.learner.algo.kl_coef > 0 and not cfg.compute.calibrated \
                and not (Path(state["started_from"]) / POLICY_JSON).is_file():
            raise KilovlaError(f"{folder}/rl_state.json: the policy this run began with, {state['started_from']}, is "
                               f"gone; it is the KL penalty's reference (learner.algo.kl_coef): put it back, or resume "
                               f"with --learner.algo.kl_coef=0")
        check_value_head(source, resuming=folder is not None)
        return cfg

    def load_agent(self, policy_dir: str, algo, sde, n_action_steps: int, privileged: tuple) -> ActorCritic:
        return load_actor_critic(policy_dir, sde, n_action_steps)

    def learner(self, model: ActorCritic, run: LearnerRun, world: distributed.World) -> Learner:
        algo = run.algo  # the KL penalty's reference: the policy the run began with, frozen
        calibrated = run.compute is not None and run.compute.calibrated
        reference = frozen_policy(run.started_from) if algo.kl_coef > 0 and not calibrated else None
        return Learner(model, algo, run.segments_per_step, run.segment_steps, run.total_steps, world, run.compute,
                       reference)


def check_value_head(source: PolicyFolder, resuming: bool) -> None:
    """A value head written before the critic read the state, found here in the driver, before Ray: from
    --policy.path its critic is relearned (said here: the learners log inside Ray, out of the user's sight);
    a run cannot be resumed with it (its learner.pt holds the same head and its optimizer state)."""
    if not (source.path / "value_head.safetensors").is_file():
        return
    note = stale_value_head(str(source.path), critic_width(source.model_config()))
    if note and resuming:
        raise KilovlaError(f"{note}: the run cannot be resumed; start a new run_dir with --policy.path={source.path}")
    if note:
        log.warning("%s: starting a fresh critic", note)

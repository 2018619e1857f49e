"""The RL learner: segments in, one optimizer step per global batch out (no Ray here; workers.py wraps it).

Per segment, GAE over its T steps with the behaviour values stored at rollout and the current
critic's value of the observation after it (the bootstrap). Samples are trained in micro-batches as
segments arrive (`StreamingStep`): the loss of a micro-batch is the sum of decoupled-PPO and value
losses over its samples, scaled by 1 / (samples in a global batch); the optimizer steps when the
global batch (B segments x T steps, spread over the learner ranks) is complete. The proximal policy
of the decoupled loss is the learner's policy as it consumes the sample: with no staleness it is the
behaviour policy and the loss is plain PPO.

The optimizer, its schedule and gradient clipping are the supervised trainer's (`train.optim`),
with the value head in its own parameter group; freezing is the trainer's `apply_freeze`; on
several ranks the model is wrapped by the trainer's `distributed.parallelize` (DDP) and only the
micro-batch that completes a global batch reduces gradients (`distributed.gradient_sync`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kilovla.rl.core import trajectory
from kilovla.rl.core.losses import decoupled_ppo_loss, gae, value_loss
from kilovla.rl.core.streaming import StreamingStep
from kilovla.rl.policy import ActorCritic
from kilovla.train import distributed
from kilovla.train.optim import OptimConfig, build_optimizer
from kilovla.train.trainer import apply_freeze


@dataclass
class AlgoConfig:
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    behav_cap: float = 2.0  # decoupled PPO: samples whose behaviour weight exceeds this are masked
    value_coef: float = 0.5
    value_clip: float = 10.0
    value_lr: float = 1e-3
    normalize_advantages: bool = True  # per micro-batch, as PPO implementations do per minibatch
    micro_batch: int = 32  # samples per forward/backward on a learner rank
    freeze_vision: bool = True
    freeze_vlm: bool = True  # piRL trains the action expert (and projections) only
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=0, min_lr_ratio=1.0,
                                                                     weight_decay=0.0))


class Learner:
    def __init__(self, model: ActorCritic, cfg: AlgoConfig, segments_per_step: int, segment_steps: int,
                 total_steps: int, world: distributed.World | None = None):
        self.cfg, self.world = cfg, world or distributed.World()
        self.model = model
        apply_freeze(model.vla, freeze_vision=cfg.freeze_vision, freeze_vlm=cfg.freeze_vlm)
        self.step_model = distributed.parallelize(model, "ddp", self.world)
        self.trainable, self.optimizer, self.scheduler = build_optimizer(
            model, cfg.optim, total_steps, extra_groups=[{"params": list(model.value_head.parameters()), "lr": cfg.value_lr}])
        per_rank = segments_per_step * segment_steps // self.world.size
        self.stream = StreamingStep(self.optimizer, per_rank, self.trainable, cfg.optim.clip_grad_norm, self.scheduler)
        self.version = 0
        self._stats: list[dict] = []

    def advantages(self, segment: trajectory.Segment) -> tuple[np.ndarray, np.ndarray]:
        """GAE over a segment: (advantages, returns), bootstrapped with the current critic."""
        last = 0.0 if segment.done[-1] else float(self.model.value(trajectory.stack([segment.next_obs]))[0])
        adv, ret = gae(torch.tensor(segment.reward, dtype=torch.float32), torch.tensor(segment.value),
                       torch.tensor(segment.done), torch.tensor(last), self.cfg.gamma, self.cfg.lam)
        return adv.numpy(), ret.numpy()

    def consume(self, segments: list[trajectory.Segment]) -> dict | None:
        """Train on these segments; returns the step's statistics when they completed a global batch."""
        adv, ret = zip(*(self.advantages(s) for s in segments))
        data = {"obs": trajectory.concat([s.obs for s in segments]),
                "chain": np.concatenate([s.chain for s in segments]),
                "stochastic": np.concatenate([s.stochastic for s in segments]),
                "logp": np.concatenate([s.logp for s in segments]), "value": np.concatenate([s.value for s in segments]),
                "adv": np.concatenate(adv), "ret": np.concatenate(ret)}
        n = len(data["adv"])
        stepped = None
        for start in range(0, n, self.cfg.micro_batch):
            rows = np.arange(start, min(n, start + self.cfg.micro_batch))
            with distributed.gradient_sync(self.step_model, sync=self.stream.completes(len(rows))):
                loss, stats = self._loss(data, rows)
                out = self.stream.backward(loss, len(rows))
            self._stats.append(stats)
            if out is not None:
                stepped = self._finish_step(out)
        return stepped

    def _loss(self, data: dict, rows: np.ndarray) -> tuple[torch.Tensor, dict]:
        t = lambda k, dtype=torch.float32: torch.as_tensor(data[k][rows], dtype=dtype)  # noqa: E731
        logp, values = self.step_model(trajectory.index(data["obs"], rows), t("chain"), t("stochastic", torch.bool))
        behav, adv = t("logp"), t("adv")
        if self.cfg.normalize_advantages and len(rows) > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        policy, stats = decoupled_ppo_loss(logp, logp.detach(), behav, adv, self.cfg.clip, self.cfg.behav_cap)
        critic = value_loss(values, t("ret"), t("value"), self.cfg.value_clip)
        stats.update(policy_loss=policy.mean().item(), value_loss=critic.mean().item(),
                     logp_gap=(logp.detach() - behav).abs().mean().item(), advantage=t("adv").mean().item())
        return (policy + self.cfg.value_coef * critic).sum(), stats

    def _finish_step(self, out: dict) -> dict:
        self.version += 1
        stats = {k: float(np.mean([s[k] for s in self._stats])) for k in self._stats[0]}
        self._stats = []
        return {"version": self.version, "grad_norm": out["grad_norm"], "lr": self.scheduler.get_last_lr()[0], **stats}

    def weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the acting weights (the VLA and the value head) for the inference servers."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

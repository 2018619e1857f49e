"""The trainer's AdamW runs fused on CPU (train/optim.py): the same updates as torch's per-parameter loop."""

import copy

import torch

from kilovla.train.optim import OptimConfig, _lr_lambda, build_optimizer


def test_the_fused_adamw_takes_the_loops_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    cfg, steps = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=5), 50
    _, opt, sched = build_optimizer(model, cfg, steps)
    assert opt.defaults["fused"] is True
    loop = torch.optim.AdamW(reference.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                             weight_decay=cfg.weight_decay, foreach=False)
    loop_sched = torch.optim.lr_scheduler.LambdaLR(loop, _lr_lambda(cfg, steps))
    for _ in range(steps):
        x = torch.randn(8, 16)
        for m, o, s in ((model, opt, sched), (reference, loop, loop_sched)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
            s.step()
    for p, q, p0 in zip(model.parameters(), reference.parameters(), start.parameters()):
        assert float((q - p0).abs().max()) > 1e-3  # the steps moved every parameter
        assert float((p - q).abs().max()) <= 1e-6 * float(q.abs().max())

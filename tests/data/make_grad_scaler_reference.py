#!/usr/bin/python3
"""Write tests/data/grad_scaler_reference.json: the scales PyTorch's GradScaler sets and
the steps it skips, step by step, for sequences of steps whose gradients hold Inf or NaN.

tests/unit/loop_test.cpp trains paratrain's DataParallel with Precision::loss_scale on the
same sequences (the bad gradients injected on one rank) and checks every step's scale and
skip against this file, so the C++ scaler is compared with PyTorch and never with itself.

GradScaler runs on the CPU from PyTorch 2.3 on (torch.amp.GradScaler("cpu")); Debian 12's
1.13 disables it without CUDA. Made with Debian 13's python3-torch 2.6 in a root of its own:

    mmdebstrap --variant=apt --include=python3-torch trixie /tmp/torchroot
    cp tests/data/make_grad_scaler_reference.py /tmp/torchroot/tmp/
    chroot /tmp/torchroot /usr/bin/python3 /tmp/make_grad_scaler_reference.py > tests/data/grad_scaler_reference.json

The output is deterministic.
"""

import json
import math
import sys

import torch

# Per step: "ok", "inf" or "nan" in the gradient.
CASES = [
    {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
     "steps": ["ok", "ok", "ok", "inf", "ok", "ok", "ok", "ok", "nan", "inf", "ok", "ok", "ok", "ok", "ok", "ok"]},
    {"init_scale": 4.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 1,
     "steps": ["ok", "inf", "ok", "ok", "nan", "nan", "inf", "ok", "ok"]},
    # Growth stops below fp32's largest number: 2^120 x 2^4 = 2^124, then 2^128 would be Inf.
    {"init_scale": 2.0 ** 120, "growth_factor": 16.0, "backoff_factor": 0.5, "growth_interval": 1,
     "steps": ["ok", "ok", "ok", "inf", "ok", "ok"]},
]


def run(case):
    scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_factor=case["growth_factor"],
                                  backoff_factor=case["backoff_factor"], growth_interval=case["growth_interval"])
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.125)
    scales, skipped = [], []
    for kind in case["steps"]:
        bad = {"ok": 2.0, "inf": math.inf, "nan": math.nan}[kind]
        opt.zero_grad()
        before = p.detach().clone()
        scaler.scale((p * torch.tensor([1.0, bad])).sum()).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(torch.equal(before, p.detach())))
        scales.append(scaler.get_scale())
    return {**case, "scale_after": scales, "skipped": skipped}


json.dump({"torch": torch.__version__, "cases": [run(c) for c in CASES]}, sys.stdout, indent=1)
print()

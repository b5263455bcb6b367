"""PyTorch's side of the checkpoint benchmark: torch.save / torch.load of the training
state (model and Adam state dicts) and of the model alone, as a DDP job's rank 0 does,
each followed by fsync (paratrain's saves are durable when they return).

    python3 checkpoint_vs_torch.py [layers 4] [dir]

Prints one JSON line per measurement, the best of 2 repetitions after a warm-up save.
"""
import json
import os
import shutil
import sys
import time

import torch

WIDTH, BATCH = 2048, 32


def model_of(layers):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(WIDTH, 10))


def durable_save(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def main(layers, directory):
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = model_of(layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    train_path, model_path = f"{directory}/train.pt", f"{directory}/model.pt"
    durable_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, train_path)  # warm-up
    best = {}

    def timed(name, fn):
        t = time.perf_counter()
        fn()
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)

    for _ in range(2):
        timed("training save", lambda: durable_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                                     train_path))

        def load_training():
            state = torch.load(train_path)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])

        timed("training load", load_training)
        timed("full save", lambda: durable_save(model.state_dict(), model_path))
        timed("full load", lambda: model.load_state_dict(torch.load(model_path)))
    sizes = {"training": os.path.getsize(train_path), "full": os.path.getsize(model_path)}
    for name, seconds in best.items():
        print(json.dumps({"implementation": "pytorch", "ranks": 1, "parameters": params, "what": name,
                          "seconds": round(seconds, 3), "mib": round(sizes[name.split()[0]] / 2**20, 1)}))
    shutil.rmtree(directory)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4, sys.argv[2] if len(sys.argv) > 2 else "torch_checkpoint.tmp")

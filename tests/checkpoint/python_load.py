"""PyTorch reads paratrain's whole-model file: torch.load gives a state dict whose names
and shapes match the C++ module's, and the same architecture built in Python with it
predicts what paratrain predicted.

    python_load.py <dir with model.pt and io.pt>

Exits 77 (ctest: skipped) when this Python has no torch, except in CI (CI set, as CI sets
it), where scripts/deps.sh has installed python3-torch and a missing torch is a failure.
"""
import os
import sys

try:
    import torch
except ImportError:
    if os.environ.get("CI"):
        print("FAIL: CI is set but this python3 has no torch: scripts/deps.sh installs python3-torch")
        sys.exit(1)
    print("skipped: this python3 has no torch (Debian: apt-get install python3-torch)")
    sys.exit(77)


class Mlp(torch.nn.Module):
    """tests/support/equivalence.hpp's Mlp with Features{.buffer = true}."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x * self.scale)))


def main(directory):
    state = torch.load(f"{directory}/model.pt")
    io = torch.load(f"{directory}/io.pt")
    model = Mlp()
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    assert got == want, f"names and shapes differ: file {got}, Python module {want}"
    model.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        out = model(io["input"])
    diff = (out - io["output"]).abs().max().item()
    print(f"{len(state)} tensors; max |python - paratrain| over {tuple(out.shape)} outputs: {diff:.3g}")
    assert diff <= 1e-6, "Python's prediction differs from paratrain's"
    # The buffer is rank 0's (1.0 everywhere), broadcast at construction, not 1.25 or 1.5.
    assert torch.equal(state["scale"], torch.ones(8)), state["scale"]
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])

#!/usr/bin/env bash
# The demo against the same training in PyTorch's DDP (gloo), side by side: time to 90%
# test accuracy, final accuracy, throughput. Usage: benchmarks/fashion_mnist_vs_torch.sh [epochs]
set -euo pipefail
cd "$(dirname "$0")/.."
epochs=${1:-5}
build=${PARATRAIN_BUILD_DIR:-build-bench}
export OMP_NUM_THREADS=1
echo "\$ scripts/mpirun.sh 2 $build/examples/fashion_mnist_ddp --epochs $epochs"
ours=$(TERM=dumb scripts/mpirun.sh 2 "$build/examples/fashion_mnist_ddp" --epochs "$epochs" | tail -1)
echo "$ours"
echo "\$ /usr/bin/python3 benchmarks/fashion_mnist_vs_torch.py --ranks 2 --epochs $epochs"
theirs=$(/usr/bin/python3 benchmarks/fashion_mnist_vs_torch.py --ranks 2 --epochs "$epochs" | tail -1)
echo "$theirs"
python3 - "$ours" "$theirs" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def f(x, fmt): return "not reached" if x is None else fmt.format(x)
print("\n| implementation | ranks | seconds to 90% | final test accuracy | samples/s | wall s |")
print("|---|---:|---:|---:|---:|---:|")
for name, r in (("paratrain DataParallel (comm::Mpi)", a), ("PyTorch DDP (gloo)", b)):
    print(f"| {name} | {r['world_size']} | {f(r['seconds_to_90'], '{:.1f}')} | {100 * r['test_accuracy']:.2f}% | "
          f"{r['samples_per_second']:.0f} | {r['wall_seconds']:.1f} |")
if a["seconds_to_90"] and b["seconds_to_90"]:
    print(f"\nPyTorch needs {b['seconds_to_90'] / a['seconds_to_90']:.2f}x paratrain's time to reach 90%; "
          f"throughput ratio {a['samples_per_second'] / b['samples_per_second']:.2f}x.")
PY

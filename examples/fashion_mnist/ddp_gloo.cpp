// Fashion-MNIST with DDP over Gloo: no MPI; ranks meet at MASTER_ADDR:MASTER_PORT,
// started by examples/launch/torchrun_style.sh (or torchrun --no-python).
#include "train.hpp"

using Strategy = paratrain::DataParallel<fashion_mnist::Net, paratrain::comm::Gloo, torch::optim::Adam>;

int main(int argc, char** argv) { return fashion_mnist::run<Strategy>(argc, argv); }

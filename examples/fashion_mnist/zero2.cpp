// Fashion-MNIST with ZeRO stage 2: DDP's processes, optimizer state and gradients sharded.
#include "train.hpp"

using Strategy = paratrain::DataParallel<fashion_mnist::Net, paratrain::comm::Mpi,
                                         paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage2>>;

int main(int argc, char** argv) { return fashion_mnist::run<Strategy>(argc, argv); }
